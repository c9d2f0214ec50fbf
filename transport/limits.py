"""Every buffer, queue, cache and size bound in meshd, with units and the reason for its value.

One module so that limits are reviewed together. Sections per subsystem; add, do not scatter.
"""

from __future__ import annotations

# --- credentials / identity -------------------------------------------------------------------
MAX_CREDENTIAL_BYTES = 4096  # a genesis or member certificate is ~400 B; refuse anything 10x larger

# --- framing / transport (issue 2) ------------------------------------------------------------

# --- daemon: control socket (issue 2, daemon) ------------------------------------------------
MAX_CONTROL_LINE_BYTES = 1 << 20  # one control request/reply line; status of a big mesh is ~100 KiB
MAX_CONTROL_CONNECTIONS = 64  # concurrent local CLI clients; more means something is looping

# --- membership / gossip (issue 3) ------------------------------------------------------------

# --- API / tunnel (issue 5) -------------------------------------------------------------------

# --- engine (issue 4) -------------------------------------------------------------------------

# --- expert RPC (issue 6) ---------------------------------------------------------------------
