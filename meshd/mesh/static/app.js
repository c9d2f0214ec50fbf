// meshd console: renders /meshd/v1/mesh and follows /meshd/v1/events. Plain JS, no dependencies.
"use strict";
(function () {
  const $ = (sel) => document.querySelector(sel);
  const SVG = "http://www.w3.org/2000/svg";
  let mesh = null;
  let requests = [];
  let selected = null;

  function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const short = (id) => (id || "-").slice(0, 8);
  const modelNames = (n) => (n.models || []).map((m) => m.name).join(", ");
  const fmt = (v, d) => (v === null || v === undefined ? "-" : typeof v === "number" ? v.toFixed(d || 0) : String(v));

  function layout(nodes) {
    // this node in the middle, the others on a circle (sorted by id, so positions are stable)
    const pos = {};
    const others = nodes.filter((n) => !n.self).sort((a, b) => (a.node_id < b.node_id ? -1 : 1));
    const cx = 300, cy = 205, r = others.length > 1 ? 150 : 120;
    nodes.filter((n) => n.self).forEach((n) => (pos[n.node_id] = [cx, cy]));
    others.forEach((n, i) => {
      const a = (2 * Math.PI * i) / Math.max(1, others.length) - Math.PI / 2;
      pos[n.node_id] = [cx + r * Math.cos(a), cy + r * Math.sin(a)];
    });
    return pos;
  }

  function renderMap() {
    const svg = $("#map");
    svg.replaceChildren();
    if (!mesh) return;
    const pos = layout(mesh.nodes);
    for (const l of mesh.links) {
      const a = pos[l.from], b = pos[l.to];
      if (!a || !b) continue;
      svg.appendChild(el("svg:line", { class: "link " + (l.path || "quic"), x1: a[0], y1: a[1], x2: b[0], y2: b[1],
        "data-from": l.from, "data-to": l.to }));
      svg.appendChild(el("svg:text", { class: "link-label", x: (a[0] + b[0]) / 2 + 4, y: (a[1] + b[1]) / 2 - 4 },
        (l.path || "quic") + " " + fmt(l.rtt_ms, 1) + " ms"));
    }
    for (const n of mesh.nodes) {
      const [x, y] = pos[n.node_id];
      const g = el("svg:g", { class: "node " + n.state + (n.self ? " self" : ""), "data-node-id": n.node_id,
        "data-state": n.state, transform: `translate(${x},${y})` });
      g.appendChild(el("svg:circle", { r: n.role === "client" ? 12 : 18 }));
      g.appendChild(el("svg:text", { y: 34 }, short(n.node_id) + (n.self ? " (this)" : "")));
      g.appendChild(el("svg:text", { class: "models", y: 48 }, modelNames(n)));
      g.addEventListener("click", () => openDrawer(n.node_id));
      svg.appendChild(g);
    }
  }

  function renderCounters() {
    const c = (mesh && mesh.counters) || {};
    $("#c-nodes").textContent = fmt(c.nodes);
    $("#c-models").textContent = fmt(c.models);
    $("#c-inflight").textContent = fmt(c.in_flight);
    $("#c-toks").textContent = fmt(c.tok_s, 1);
    $("#mesh-name").textContent = mesh ? `${mesh.mesh_name || ""} (${short(mesh.mesh_id)})` : "-";
  }

  function renderNodes() {
    const tb = $("#nodes tbody");
    tb.replaceChildren();
    if (!mesh) return;
    for (const n of mesh.nodes) {
      const tr = el("tr", { "data-node-id": n.node_id, "data-state": n.state });
      tr.appendChild(el("td", {}, short(n.node_id) + (n.self ? " (this)" : "")));
      tr.appendChild(el("td", {}, n.role));
      const st = el("td"); st.appendChild(el("span", { class: "state " + n.state }, n.state)); tr.appendChild(st);
      tr.appendChild(el("td", { class: "models" }, modelNames(n) || "-"));
      tr.appendChild(el("td", {}, fmt(n.load && n.load.in_flight)));
      tr.appendChild(el("td", {}, fmt(n.rtt_ms, 1)));
      tr.addEventListener("click", () => openDrawer(n.node_id));
      tb.appendChild(tr);
    }
  }

  function renderRequests() {
    const tb = $("#requests tbody");
    tb.replaceChildren();
    for (const r of requests.slice().reverse().slice(0, 50)) {
      const tr = el("tr", { class: "request" });
      const t = new Date(r.time * 1000);
      tr.appendChild(el("td", {}, t.toLocaleTimeString()));
      tr.appendChild(el("td", { class: "model" }, r.model || "-"));
      tr.appendChild(el("td", {}, r.route));
      tr.appendChild(el("td", {}, short(r.node)));
      tr.appendChild(el("td", {}, fmt(r.tokens)));
      tr.appendChild(el("td", {}, fmt(r.latency_ms, 0)));
      tr.appendChild(el("td", { class: r.status === 200 ? "status-ok" : "status-err" }, String(r.status)));
      tb.appendChild(tr);
    }
  }

  function openDrawer(id) { selected = id; renderDrawer(); }

  // a --stage offer: its layers (a pin, or any the planner gives), the checkpoint as status names it (the
  // first 16 hex digits, and the model some node serves from it), the memory offered
  function stageText(s) {
    const fp = String(s.model_fp || "").slice(0, 16);
    const names = [];
    for (const x of (mesh && mesh.nodes) || []) {
      for (const m of x.models || []) {
        if (String(m.fingerprint || "").slice(0, 16) === fp && !names.includes(m.name)) names.push(m.name);
      }
    }
    const layers = Array.isArray(s.pin) ? `layers ${s.pin[0]}-${s.pin[1]}` : "any layers";
    const mib = typeof s.free_kb === "number" ? `, ${Math.round(s.free_kb * 1000 / 1048576)} MiB offered` : "";
    return `${layers} of ${fp}${names.length ? " (" + names.join(", ") + ")" : ""}${mib}`;
  }

  function renderDrawer() {
    const d = $("#drawer");
    const n = mesh && mesh.nodes.find((x) => x.node_id === selected);
    if (!n) { d.hidden = true; return; }
    d.hidden = false;
    $("#d-title").textContent = short(n.node_id) + (n.self ? " (this node)" : "");
    const rows = [
      ["node id", n.node_id], ["role", n.role], ["state", n.state], ["version", `${n.version} (protocol ${n.protocol})`],
      ["api", n.api], ["addresses", (n.addrs || []).join(", ")],
      ["models", (n.models || []).map((m) => `${m.name} [${m.kind}, ctx ${m.ctx}, ${String(m.fingerprint).slice(0, 12)}]`).join("; ") || "-"],
      ["expert shards", (n.experts || []).map((e) => `layers ${e.layers.join("-")} experts ${e.experts.join("-")}`).join("; ") || "-"],
      ["stages", (n.stages || []).map(stageText).join("; ") || "-"],
      ["load", n.load ? `${n.load.in_flight} in flight, ${n.load.queue} queued, ${fmt(n.load.tok_s, 1)} tok/s, ${n.load.slots} slots` : "-"],
      ["memory", n.capacity ? `${n.capacity.free_mb} MiB free of ${n.capacity.ram_mb} MiB, ${n.capacity.cpus} cores` : "-"],
      ["round trip", n.rtt_ms === null ? "-" : fmt(n.rtt_ms, 2) + " ms"], ["path", n.path || "-"],
      ["last seen", n.last_seen_s === null ? "-" : fmt(n.last_seen_s, 1) + " s ago"],
    ];
    const dl = $("#d-body");
    dl.replaceChildren();
    for (const [k, v] of rows) { dl.appendChild(el("dt", {}, k)); dl.appendChild(el("dd", {}, v === null ? "-" : String(v))); }
  }

  function render() { renderCounters(); renderMap(); renderNodes(); renderDrawer(); }

  function apply(snap) {
    mesh = snap;
    if (snap.requests) requests = snap.requests.slice();
    render();
    renderRequests();
  }

  $("#drawer-close").addEventListener("click", () => { selected = null; renderDrawer(); });

  fetch("/meshd/v1/mesh", { credentials: "same-origin" }).then((r) => r.json()).then(apply).catch(() => {});
  function follow() {
    const es = new EventSource("/meshd/v1/events");
    es.addEventListener("open", () => { $("#conn").textContent = "live"; $("#conn").className = "conn live"; });
    es.addEventListener("mesh", (e) => apply(JSON.parse(e.data)));
    es.addEventListener("request", (e) => { requests.push(JSON.parse(e.data)); requests = requests.slice(-200); renderRequests(); });
    es.addEventListener("error", () => { $("#conn").textContent = "reconnecting…"; $("#conn").className = "conn"; });
  }
  follow();
})();
