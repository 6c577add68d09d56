// The "Running now" page: draws its table and charts from the JSON the page carries, then
// fetches the same JSON every refresh_ms and replaces the table's rows and each chart's data
// in place (vega's changeset: no page reload, no redraw of the chart's frame). Each chart's
// element gets data-drawn="1" once drawn, the page data-refreshed="N" after each refresh and
// data-points the points it was given (the browser test waits for them).
(function () {
  "use strict";
  var views = {};
  var refreshes = 0;

  function text(value) { return value === null || value === undefined ? "–" : String(value); }
  function fixed(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }
  function cell(row, content) {
    var td = document.createElement("td");
    td.textContent = content;
    row.appendChild(td);
  }

  function table(payload) {
    var body = document.getElementById("profllm-running-rows");
    body.textContent = "";
    payload.running.forEach(function (c) {
      var row = document.createElement("tr");
      cell(row, c.case);
      cell(row, c.worker);
      cell(row, c.stage + (c.warming_up ? " (warming up)" : "") + (c.detail ? " " + c.detail : "")
        + " for " + fixed(c.stage_for_s, 0) + " s");
      cell(row, c.total ? c.done + " / " + c.total : text(c.done || null));
      cell(row, text(c.failed));
      cell(row, fixed(c.achieved_rate, 1) + (c.target_rate ? " of " + fixed(c.target_rate, 1) : ""));
      cell(row, fixed(c.median_ttft_ms, 1));
      cell(row, text(c.running) + " / " + text(c.waiting));
      cell(row, c.kv_cache_usage === null || c.kv_cache_usage === undefined ? "–"
        : (100 * c.kv_cache_usage).toFixed(0) + " %");
      body.appendChild(row);
    });
    var finished = document.getElementById("profllm-running-finished");
    finished.textContent = "";
    payload.finished.forEach(function (f) {
      var item = document.createElement("li");
      var link = document.createElement("a");
      link.href = f.run_url;
      link.textContent = f.case;
      item.appendChild(link);
      item.appendChild(document.createTextNode(" (run " + f.run_id + (f.loaded ? ")"
        : "; its page once the session loads its record)")));
      finished.appendChild(item);
    });
    if (!payload.finished.length) {
      var none = document.createElement("li");
      none.textContent = "None in the last minute.";
      finished.appendChild(none);
    }
    // Live files left out (not a regular file, too big, a field of the wrong type) and
    // cases whose process died: one line each, as text.
    var notes = document.getElementById("profllm-running-notes");
    notes.textContent = "";
    (payload.notes || []).forEach(function (note) {
      var item = document.createElement("li");
      item.textContent = note;
      notes.appendChild(item);
    });
    var status = document.getElementById("profllm-running-status");
    status.textContent = payload.running.length
      ? payload.running.length + " case(s) running, as of " + new Date(payload.now * 1000).toLocaleTimeString()
      : "Nothing runs now (as of " + new Date(payload.now * 1000).toLocaleTimeString() + ").";
  }

  function update(payload) {
    table(payload);
    document.getElementById("profllm-running").setAttribute("data-points", String(
      Object.keys(payload.data).reduce(function (n, k) { return n + payload.data[k].length; }, 0)));
    Object.keys(views).forEach(function (id) {
      var entry = views[id];
      var rows = payload.data[entry.dataset] || [];
      entry.view.change(entry.dataset, vega.changeset().remove(function () { return true; }).insert(rows)).run();
    });
  }

  function poll(url, every) {
    window.setTimeout(function () {
      fetch(url, { headers: { accept: "application/json" }, cache: "no-store" })
        .then(function (response) { return response.json(); })
        .then(function (payload) {
          update(payload);
          refreshes += 1;
          document.getElementById("profllm-running").setAttribute("data-refreshed", String(refreshes));
        })
        .catch(function (error) {
          document.getElementById("profllm-running-status").textContent = "Refresh failed: " + error;
        })
        .then(function () { poll(url, every); });
    }, every);
  }

  function start() {
    var root = document.getElementById("profllm-running");
    var specs = JSON.parse(document.getElementById("profllm-running-specs").textContent);
    var initial = JSON.parse(document.getElementById("profllm-running-initial").textContent);
    table(initial);
    var drawn = Object.keys(specs).map(function (id) {
      var element = document.getElementById(id);
      var dataset = specs[id].data.name;
      return vegaEmbed(element, specs[id], { actions: false, renderer: "svg" }).then(function (result) {
        views[id] = { view: result.view, dataset: dataset };
        result.view.change(dataset, vega.changeset().insert(initial.data[dataset] || [])).run();
        element.setAttribute("data-drawn", "1");
      }).catch(function (error) {
        element.setAttribute("data-error", String(error));
        element.textContent = "This chart could not be drawn: " + error;
      });
    });
    Promise.all(drawn).then(function () { poll(root.getAttribute("data-json-url"), initial.refresh_ms); });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
