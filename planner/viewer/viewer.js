(function () {
  "use strict";
  // The chart: zoom and pan move the time window [t0, t1]; each chunk of drawn spans gets a new transform, and
  // the time ticks and in-bar labels are redrawn for the window. Hover finds the span under the cursor by binary
  // search in time, so even sub-pixel operations of a 2,000-node plan can be read.
  // The node table: only the rows in view are in the document (all 2,001 rows of a long plan took 1-3 s of
  // layout on a busy 2-core machine); sorting and filtering work on the data.
  var data = JSON.parse(document.getElementById("plan-data").textContent);
  var L = data.layout, nodes = data.nodes, spans = data.spans, memory = data.memory;
  var N = { id: 0, label: 1, kind: 2, op: 3, size: 4, decision: 5, computed: 6, fastest: 7, fastestMs: 8,
    chosen: 9, ms: 10, workspace: 11, position: 12 };
  var SVG_NS = "http://www.w3.org/2000/svg";
  var STREAMS = ["compute", "d2h", "h2d"];
  var KIND_NAMES = { compute: "compute", recompute: "recompute", offload: "offload to host",
    prefetch: "prefetch to device", stall: "stall (compute stream waits)" };
  var svg = document.getElementById("chart"), box = svg.parentNode, tip = document.getElementById("tip");
  var axis = document.getElementById("time-axis"), labels = document.getElementById("labels");
  var marks = document.getElementById("hover-marks"), cursor = document.getElementById("cursor");
  var windowText = document.getElementById("window");
  var chunks = Array.prototype.map.call(document.querySelectorAll("#zoom g.chunk"), function (g) {
    return { el: g, base: +g.dataset.base, start: +g.dataset.start, end: +g.dataset.end, shown: true };
  });
  var domain = data.domain_ms, t0 = 0, t1 = domain, minWindow = domain / L.max_zoom;
  var right = L.left + L.plot_width, pending = false, marked = -1, drag = null, svgWidth = 0;
  var stretched = Array.prototype.slice.call(svg.querySelectorAll("[data-stretch]"));
  var nodeSpans = nodes.map(function () { return []; });
  STREAMS.forEach(function (stream) {
    spans[stream].forEach(function (span, i) { nodeSpans[span[1]].push([stream, i]); });
  });

  // Numbers -------------------------------------------------------------------------------------------------
  function group(n, decimals) {
    return n.toLocaleString("en-US", { minimumFractionDigits: decimals || 0, maximumFractionDigits: decimals || 0 });
  }
  function fmtMs(v) {
    var a = Math.abs(v);
    if (a >= 100) return group(v, 1) + " ms";
    if (a >= 1 || a === 0) return group(v, 2) + " ms";
    if (a >= 0.001) return group(v * 1000, 1) + " µs";
    return group(v * 1e6, 0) + " ns";
  }
  function fmtBytes(b) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"], i = 0;
    while (Math.abs(b) >= 1024 && i < units.length - 1) { b /= 1024; i++; }
    return i === 0 ? b.toFixed(0) + " B" : b.toFixed(2) + " " + units[i];
  }
  function niceStep(extent, count) {
    var raw = extent / count, power = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map(function (f) { return f * power; }).filter(function (s) { return raw <= s; })[0];
  }
  function svgEl(name, attrs, text) {
    var node = document.createElementNS(SVG_NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Chart: drawing for the window -------------------------------------------------------------------------------
  function k() { return L.plot_width / (t1 - t0); }
  function xOf(t) { return L.left + (t - t0) * k(); }
  function tOf(x) { return t0 + (x - L.left) / k(); }
  // First span on `stream` that ends at or after t (spans on one stream never overlap).
  function firstEndingAfter(stream, t) {
    var list = spans[stream], lo = 0, hi = list.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (list[mid][3] < t) lo = mid + 1; else hi = mid; }
    return lo;
  }
  function drawAxis() {
    var step = niceStep(t1 - t0, Math.max(3, Math.round(L.plot_width / L.tick_spacing))), decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    var fragment = document.createDocumentFragment();
    for (var i = Math.ceil(t0 / step - 1e-9); i * step <= t1 + step * 1e-9; i++) {
      var x = xOf(i * step).toFixed(2);
      fragment.appendChild(svgEl("line", { class: "grid", x1: x, x2: x, y1: L.lanes.compute[0], y2: L.axis_y + 5 }));
      fragment.appendChild(svgEl("text", { class: "tick", x: x, y: L.axis_y + 18, "text-anchor": "middle" },
        group(i * step + 0, decimals)));
    }
    axis.replaceChildren(fragment);
  }
  // The name if it fits, else the id (often shorter: "features_2:bwd"), else the id's end, which tells
  // neighbours apart ("…_34:bwd").
  function shortName(node, room) {
    if (node[N.label].length <= room) return node[N.label];
    var id = node[N.id];
    return id.length <= room ? id : "…" + id.slice(id.length - room + 1);
  }
  function drawLabels() {
    var fragment = document.createDocumentFragment(), count = 0;
    STREAMS.forEach(function (stream) {
      var list = spans[stream], lane = L.lanes[stream];
      for (var i = firstEndingAfter(stream, t0); i < list.length && list[i][2] <= t1 && count < 800; i++) {
        var span = list[i], x0 = Math.max(xOf(span[2]), L.left), x1 = Math.min(xOf(span[3]), right);
        var room = Math.floor((x1 - x0 - 6) / 6);
        if (room < 6) continue;
        var light = span[0] === "compute" || span[0] === "stall";
        fragment.appendChild(svgEl("text", { x: (x0 + 3).toFixed(1), y: lane[0] + lane[1] / 2 + 4, class: light ? "light" : "" },
          span[0] === "stall" ? "stall" : shortName(nodes[span[1]], room)));
        count++;
      }
    });
    labels.replaceChildren(fragment);
  }
  function drawMarks() {
    var fragment = document.createDocumentFragment();
    if (marked >= 0) {
      nodeSpans[marked].forEach(function (ref) {
        var span = spans[ref[0]][ref[1]], lane = L.lanes[ref[0]], x0 = xOf(span[2]), x1 = xOf(span[3]);
        if (x1 < L.left - 4 || x0 > right + 4) return;
        var width = Math.max(x1 - x0, 3);
        fragment.appendChild(svgEl("rect", { x: (x0 - (width - (x1 - x0)) / 2).toFixed(1), y: lane[0] - 2,
          width: width.toFixed(1), height: lane[1] + 4 }));
      });
    }
    marks.replaceChildren(fragment);
  }
  // The drawing is as wide as its box in CSS pixels (text keeps its size): what spans the plot follows.
  function fitWidth() {
    var width = Math.max(L.min_width, Math.floor(box.clientWidth));
    if (width === svgWidth) return;
    svgWidth = width;
    L.plot_width = width - L.left - L.right;
    right = L.left + L.plot_width;
    svg.setAttribute("viewBox", "0 0 " + width + " " + L.height);
    svg.style.width = width + "px";
    svg.style.height = L.height + "px";
    stretched.forEach(function (node) {
      var how = node.dataset.stretch;
      if (how === "width") node.setAttribute("width", L.plot_width);
      else if (how === "x2") node.setAttribute("x2", right);
      else if (how === "center") node.setAttribute("x", L.left + L.plot_width / 2);
      else node.setAttribute("x", right - +how.split(":")[1]);
    });
  }
  function render() {
    pending = false;
    fitWidth();
    var started = performance.now(), scale = k();
    chunks.forEach(function (chunk) {
      var shown = chunk.end >= t0 && chunk.start <= t1;
      if (shown !== chunk.shown) { chunk.el.style.display = shown ? "" : "none"; chunk.shown = shown; }
      if (shown) chunk.el.setAttribute("transform",
        "translate(" + (L.left + (chunk.base - t0) * scale) + ",0) scale(" + scale + ",1)");
    });
    drawAxis();
    drawLabels();
    drawMarks();
    svg.dataset.t0 = t0;
    svg.dataset.t1 = t1;
    windowText.textContent = fmtMs(t0) + " – " + fmtMs(t1) + "  (×" + (domain / (t1 - t0)).toPrecision(3) + ")";
    svg.dataset.renderMs = (performance.now() - started).toFixed(2);
  }
  function update() { if (!pending) { pending = true; requestAnimationFrame(render); } }
  function setWindow(a, b) {
    var width = Math.min(domain, Math.max(minWindow, b - a));
    a = Math.min(Math.max(0, a), domain - width);
    t0 = a; t1 = a + width;
    update();
  }
  function zoomAt(t, factor) { setWindow(t - (t - t0) * factor, t + (t1 - t) * factor); }
  function pan(fraction) { setWindow(t0 + (t1 - t0) * fraction, t1 + (t1 - t0) * fraction); }
  function zoomToNode(n) {
    var refs = nodeSpans[n];
    if (!refs.length) return;
    var a = Infinity, b = -Infinity;
    refs.forEach(function (ref) { var s = spans[ref[0]][ref[1]]; a = Math.min(a, s[2]); b = Math.max(b, s[3]); });
    var pad = Math.max((b - a) * 0.15, domain * 0.002);
    marked = n;
    setWindow(a - pad, b + pad);
  }

  // Chart: hover ---------------------------------------------------------------------------------------------
  function svgPoint(event) {
    var point = svg.createSVGPoint();
    point.x = event.clientX; point.y = event.clientY;
    return point.matrixTransform(svg.getScreenCTM().inverse());
  }
  function laneAt(y) {
    for (var i = 0; i < STREAMS.length; i++) {
      var lane = L.lanes[STREAMS[i]];
      if (y >= lane[0] - 3 && y <= lane[0] + lane[1] + 3) return STREAMS[i];
    }
    return null;
  }
  // The span under time t on `stream`, or the nearest one within 4 pixels.
  function spanAt(stream, t) {
    var list = spans[stream], slack = 4 / k(), best = -1, distance = Infinity;
    for (var i = Math.max(0, firstEndingAfter(stream, t - slack) - 1); i < list.length && list[i][2] <= t + slack; i++) {
      var d = t < list[i][2] ? list[i][2] - t : t > list[i][3] ? t - list[i][3] : 0;
      if (d <= slack && d < distance) { best = i; distance = d; }
    }
    return best;
  }
  function memoryAt(t) {
    var times = memory[0], lo = 0, hi = times.length;
    while (lo < hi) { var mid = (lo + hi) >> 1; if (times[mid] <= t) lo = mid + 1; else hi = mid; }
    return memory[1][Math.max(0, lo - 1)];
  }
  function showTip(title, rows, event) {
    var table = document.createElement("table");
    rows.forEach(function (row) {
      var tr = table.insertRow(), th = document.createElement("th");
      th.textContent = row[0];
      tr.appendChild(th);
      tr.insertCell().textContent = row[1];
    });
    var heading = document.createElement("div");
    heading.className = "tip-title";
    heading.textContent = title;
    tip.replaceChildren(heading, table);
    tip.hidden = false;
    // Fixed to the viewport, so the chart's box never clips it; it flips away from the window's edges.
    var x = event.clientX + 14, y = event.clientY + 14;
    if (x + tip.offsetWidth > window.innerWidth) x = Math.max(0, event.clientX - tip.offsetWidth - 14);
    if (y + tip.offsetHeight > window.innerHeight) y = Math.max(0, event.clientY - tip.offsetHeight - 14);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function spanRows(stream, i) {
    var span = spans[stream][i], node = nodes[span[1]], kind = span[0], rows = [["operation", KIND_NAMES[kind]]];
    if (kind === "stall") rows.push(["waits for", span[6]]);
    rows.push(["node id", node[N.id]], ["node", node[N.kind] + " · " + node[N.op]]);
    rows.push(["time", fmtMs(span[2]) + " → " + fmtMs(span[3])], ["duration", fmtMs(span[3] - span[2])],
      ["stage", String(span[4])]);
    if (kind === "compute" || kind === "recompute") {
      var fastest = span[5] === node[N.fastest] ? " (the fastest)" : "  ·  fastest: " + node[N.fastest] + " " +
        fmtMs(node[N.fastestMs]) + " (+" + fmtMs(span[3] - span[2] - node[N.fastestMs]) + ")";
      rows.push(["algorithm", span[5] + fastest], ["workspace", fmtBytes(span[6])]);
    }
    rows.push(["tensor", fmtBytes(node[N.size])]);
    if ((kind === "offload" || kind === "prefetch") && span[3] > span[2]) {
      rows.push(["rate", (node[N.size] / (span[3] - span[2]) / 1e6).toFixed(2) + " GB/s (with latency)"]);
    }
    rows.push(["decision", node[N.decision] + "  ·  computed " + node[N.computed] + "×"]);
    return rows;
  }
  function setMarked(n) { if (n !== marked) { marked = n; drawMarks(); } }
  function leave() { tip.hidden = true; cursor.setAttribute("visibility", "hidden"); setMarked(-1); }
  function hover(event) {
    var p = svgPoint(event);
    if (p.x < L.left || p.x > right || p.y < L.lanes.compute[0] - 3 || p.y > L.axis_y) { leave(); return; }
    var t = tOf(p.x), stream = laneAt(p.y);
    cursor.setAttribute("x1", p.x); cursor.setAttribute("x2", p.x); cursor.setAttribute("visibility", "visible");
    if (stream) {
      var i = spanAt(stream, t);
      if (i < 0) { tip.hidden = true; setMarked(-1); return; }
      var span = spans[stream][i];
      setMarked(span[1]);
      showTip(nodes[span[1]][N.label], spanRows(stream, i), event);
    } else if (p.y >= L.memory[0]) {
      var used = memoryAt(t), rows = [["in use", fmtBytes(used)]];
      if (data.budget_bytes !== null) {
        rows.push(["budget", fmtBytes(data.budget_bytes) + " (" + (100 * used / data.budget_bytes).toFixed(1) + "% used)"]);
      }
      rows.push(["fixed", fmtBytes(data.fixed_bytes)]);
      var running = spanAt("compute", t);
      if (running >= 0) rows.push(["compute stream", KIND_NAMES[spans.compute[running][0]] + ": " +
        nodes[spans.compute[running][1]][N.label]]);
      setMarked(-1);
      showTip("at " + fmtMs(t), rows, event);
    } else { tip.hidden = true; setMarked(-1); }
  }

  // Chart: zoom, pan, keys -----------------------------------------------------------------------------------
  svg.addEventListener("wheel", function (event) {
    var p = svgPoint(event);
    if (p.x < L.left || p.x > right) return;
    event.preventDefault();
    var unit = event.deltaMode === 1 ? 16 : event.deltaMode === 2 ? 400 : 1;
    if (event.shiftKey || Math.abs(event.deltaX) > Math.abs(event.deltaY)) {
      pan((event.deltaX || event.deltaY) * unit / L.plot_width);
    } else {
      zoomAt(tOf(p.x), Math.exp(event.deltaY * unit * 0.002));
    }
  }, { passive: false });
  svg.addEventListener("pointerdown", function (event) {
    if (event.button !== 0) return;
    // Time per screen pixel: the viewBox is scaled to the element's width.
    drag = { x: event.clientX, t0: t0, t1: t1, moved: false,
      perPixel: (t1 - t0) / L.plot_width * svg.viewBox.baseVal.width / svg.getBoundingClientRect().width };
    svg.setPointerCapture(event.pointerId);
  });
  svg.addEventListener("pointermove", function (event) {
    if (drag && (drag.moved || Math.abs(event.clientX - drag.x) > 3)) {
      drag.moved = true;
      svg.classList.add("dragging");
      var shift = (drag.x - event.clientX) * drag.perPixel;
      setWindow(drag.t0 + shift, drag.t1 + shift);
      tip.hidden = true;
      return;
    }
    hover(event);
  });
  svg.addEventListener("pointerup", function () {
    var clicked = drag && !drag.moved;
    drag = null;
    svg.classList.remove("dragging");
    if (clicked && marked >= 0) showRow(marked);
  });
  svg.addEventListener("pointerleave", function () { if (!drag) leave(); });
  svg.addEventListener("dblclick", function () { setWindow(0, domain); });
  svg.addEventListener("keydown", function (event) {
    var actions = { "+": function () { zoomAt((t0 + t1) / 2, 0.5); }, "=": function () { zoomAt((t0 + t1) / 2, 0.5); },
      "-": function () { zoomAt((t0 + t1) / 2, 2); }, "0": function () { setWindow(0, domain); },
      ArrowLeft: function () { pan(-0.2); }, ArrowRight: function () { pan(0.2); } };
    if (actions[event.key]) { event.preventDefault(); actions[event.key](); }
  });
  document.getElementById("zoom-in").addEventListener("click", function () { zoomAt((t0 + t1) / 2, 0.5); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoomAt((t0 + t1) / 2, 2); });
  document.getElementById("zoom-reset").addEventListener("click", function () { marked = -1; setWindow(0, domain); });

  // Node table -----------------------------------------------------------------------------------------------
  var tableBox = document.getElementById("table-box"), tbody = document.getElementById("node-rows");
  var filter = document.getElementById("filter"), shownText = document.getElementById("shown");
  var rowHeight = 0, rowsPending = false, flashed = -1;
  var searchText = nodes.map(function (n) {
    return [n[N.id], n[N.label], n[N.op], n[N.kind], n[N.decision], n[N.chosen].join(" "), n[N.fastest]].join(" ").toLowerCase();
  });
  var order = nodes.map(function (_, i) { return i; }), shown = order.slice(), sortColumn = -1, sortDirection = 1;
  function slower(n) { return nodes[n][N.ms] - nodes[n][N.fastestMs]; }
  function changed(n) { return nodes[n][N.chosen].some(function (name) { return name !== nodes[n][N.fastest]; }); }
  // One entry per column: the value it sorts by, and how its cell is filled.
  var COLUMNS = [
    [function (n) { return nodes[n][N.position]; }, function (td, n) { td.className = "num"; td.textContent = nodes[n][N.position]; }],
    [function (n) { return nodes[n][N.label]; }, function (td, n) { twoLines(td, nodes[n][N.label], nodes[n][N.label] !== nodes[n][N.id] ? nodes[n][N.id] : ""); }],
    [function (n) { return nodes[n][N.op]; }, function (td, n) { twoLines(td, nodes[n][N.op], nodes[n][N.kind]); }],
    [function (n) { return nodes[n][N.size]; }, function (td, n) { td.className = "num"; td.textContent = fmtBytes(nodes[n][N.size]); }],
    [function (n) { return nodes[n][N.decision]; }, function (td, n) {
      var badge = document.createElement("span");
      badge.className = "badge " + nodes[n][N.decision].replace(" + ", "-");
      badge.textContent = nodes[n][N.decision];
      td.appendChild(badge);
    }],
    [function (n) { return nodes[n][N.computed]; }, function (td, n) { td.className = "num"; td.textContent = nodes[n][N.computed]; }],
    [function (n) { return nodes[n][N.chosen].join(", "); }, function (td, n) {
      td.className = changed(n) ? "changed" : "";
      algorithm(td, nodes[n][N.chosen].join(", ") || "—");
    }],
    [function (n) { return nodes[n][N.fastest]; }, function (td, n) { algorithm(td, nodes[n][N.fastest]); }],
    [function (n) { return nodes[n][N.ms]; }, function (td, n) { td.className = "num"; td.textContent = fmtMs(nodes[n][N.ms]); }],
    [slower, function (td, n) { td.className = "num"; td.textContent = slower(n) > 0 ? "+" + fmtMs(slower(n)) : "—"; }],
    [function (n) { return nodes[n][N.workspace]; }, function (td, n) {
      td.className = "num"; td.textContent = nodes[n][N.computed] ? fmtBytes(nodes[n][N.workspace]) : "—";
    }]
  ];
  function twoLines(td, first, second, secondClass) {
    var top = document.createElement("div"), bottom = document.createElement("div");
    top.className = "line"; top.textContent = first; top.title = first;
    bottom.className = secondClass === undefined ? "line sub" : secondClass; bottom.textContent = second;
    bottom.title = second;
    td.append(top, bottom);
  }
  // Two algorithms, or one with two parts ("data=winograd+filter=fft_tiling"), take a line each.
  function algorithm(td, text) {
    var comma = text.indexOf(", "), plus = text.indexOf("+");
    var cut = comma >= 0 ? comma : plus >= 0 ? plus + 1 : -1;
    if (cut < 0) { td.textContent = text; td.title = text; return; }
    twoLines(td, text.slice(0, cut), text.slice(comma >= 0 ? cut + 2 : cut), "line");
    td.title = text;
  }
  function spacer(height) {
    var tr = document.createElement("tr"), td = tr.insertCell();
    tr.className = "spacer";
    td.colSpan = COLUMNS.length;
    td.style.height = height + "px";
    return tr;
  }
  function drawRows() {
    rowsPending = false;
    var height = rowHeight || 38, headHeight = tableBox.querySelector("thead").offsetHeight;
    var first = Math.max(0, Math.floor((tableBox.scrollTop - headHeight) / height) - 10);
    var last = Math.min(shown.length, first + Math.ceil(tableBox.clientHeight / height) + 20);
    var fragment = document.createDocumentFragment();
    if (first > 0) fragment.appendChild(spacer(first * height));
    for (var i = first; i < last; i++) {
      var n = shown[i], tr = document.createElement("tr");
      tr.dataset.n = n;
      tr.className = "row" + (n === flashed ? " flash" : "");
      COLUMNS.forEach(function (column) { column[1](tr.insertCell(), n); });
      fragment.appendChild(tr);
    }
    if (last < shown.length) fragment.appendChild(spacer((shown.length - last) * height));
    tbody.replaceChildren(fragment);
    if (!rowHeight && last > first) { rowHeight = tbody.querySelector("tr.row").getBoundingClientRect().height || 38; }
    tableBox.dataset.rendered = last - first;
  }
  function updateRows() { if (!rowsPending) { rowsPending = true; requestAnimationFrame(drawRows); } }
  function applyFilter() {
    var needle = filter.value.trim().toLowerCase();
    shown = order.filter(function (n) { return needle === "" || searchText[n].indexOf(needle) >= 0; });
    shownText.textContent = group(shown.length) + " of " + group(nodes.length) + " nodes";
    tableBox.scrollTop = 0;
    drawRows();
  }
  function sortBy(column) {
    sortDirection = column === sortColumn ? -sortDirection : 1;
    sortColumn = column;
    var key = COLUMNS[column][0];
    order.sort(function (a, b) {
      var x = key(a), y = key(b);
      return (x < y ? -1 : x > y ? 1 : a - b) * sortDirection;
    });
    Array.prototype.forEach.call(document.querySelectorAll("table.nodes thead th"), function (th, i) {
      th.setAttribute("aria-sort", i === column ? (sortDirection > 0 ? "ascending" : "descending") : "none");
    });
    applyFilter();
  }
  function showRow(n) {
    if (shown.indexOf(n) < 0) { filter.value = ""; applyFilter(); }
    flashed = n;
    var height = rowHeight || 38;
    tableBox.scrollTop = shown.indexOf(n) * height - tableBox.clientHeight / 2 + height;
    drawRows();
    tableBox.scrollIntoView({ block: "nearest" });
    setTimeout(function () { if (flashed === n) { flashed = -1; updateRows(); } }, 1500);
  }
  tableBox.addEventListener("scroll", updateRows);
  window.addEventListener("resize", function () { updateRows(); update(); });
  filter.addEventListener("input", applyFilter);
  tbody.addEventListener("click", function (event) {
    var row = event.target.closest("tr.row");
    if (!row) return;
    zoomToNode(+row.dataset.n);
    svg.scrollIntoView({ block: "nearest" });
  });
  Array.prototype.forEach.call(document.querySelectorAll("table.nodes thead button"), function (button, i) {
    button.addEventListener("click", function () { sortBy(i); });
  });

  render();
  drawRows();
  document.body.dataset.ready = "1";
})();
