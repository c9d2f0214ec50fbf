"""Limits of the mesh view, its connections and the console."""

from __future__ import annotations

LINK_DIAL_TIMEOUT_S = 5.0  # dialling a member at its record's addresses (a starved handshake can take seconds)
LINK_DIAL_RETRY_S = 1.0  # a member whose dial just failed is not redialled sooner than this
LINK_MAX_GOSSIP_DIALS = 4  # handshakes in progress for gossip at once; more frames to unconnected members wait
LINK_MIN_IDLE_S = 2.0  # a connection unused this long may be closed to make room (least recently used)
LINK_CAP_HEADROOM = 16  # links kept below the transport's connection cap (room for inbound connections)
REQUEST_LOG_SIZE = 200  # recent API requests kept for the console
EVENTS_MAX_CLIENTS = 32  # console pages subscribed to /meshd/v1/events at once; a new one ends the oldest
EVENTS_INTERVAL_S = 0.5  # a mesh snapshot is pushed to subscribers at most this often
EVENTS_KEEPALIVE_S = 15.0  # an SSE comment this often on a quiet mesh (proxies drop silent streams)
TOK_RATE_WINDOW_S = 10.0  # "recent tokens/s" averages over this window
