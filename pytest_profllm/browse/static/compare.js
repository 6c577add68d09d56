// The landing table: a box on each run to tick two, then one click compares the two runs
// (the compare_runs query) or their sessions (compare_sessions). It only builds links to the
// database's read-only canned queries: nothing is written. The older run is A, the newer B.
(function () {
  "use strict";
  function text(row, column) {
    var cell = row.querySelector("td.col-" + column);
    return cell ? cell.textContent.trim() : "";
  }
  function setup() {
    var table = document.querySelector("table.rows-and-columns");
    if (!table || !table.querySelector("tbody td.col-run_id")) { return; }
    // The landing table is /<database>/runs: the canned queries are beside it.
    var base = window.location.pathname.replace(/\/[^\/]*$/, "");
    var bar = document.createElement("p");
    bar.id = "profllm-compare";
    var hint = document.createElement("span");
    function link(id, label) {
      var a = document.createElement("a");
      a.id = id;
      a.className = "profllm-compare-link";
      a.textContent = label;
      return a;
    }
    var runs = link("profllm-compare-runs", "Compare the two runs");
    var sessions = link("profllm-compare-sessions", "Compare their sessions");
    bar.appendChild(document.createTextNode("Tick two runs: "));
    bar.appendChild(runs);
    bar.appendChild(document.createTextNode(" · "));
    bar.appendChild(sessions);
    bar.appendChild(document.createTextNode(" "));
    bar.appendChild(hint);
    table.parentNode.insertBefore(bar, table);

    var headRow = table.querySelector("thead tr");
    if (headRow) {
      var th = document.createElement("th");
      th.scope = "col";
      th.textContent = "compare";
      headRow.insertBefore(th, headRow.firstChild);
    }
    var boxes = [];
    Array.prototype.forEach.call(table.querySelectorAll("tbody tr"), function (row) {
      var cell = document.createElement("td");
      cell.className = "profllm-compare-cell";
      var runId = text(row, "run_id");
      if (runId) {
        var box = document.createElement("input");
        box.type = "checkbox";
        box.className = "profllm-compare-box";
        box.setAttribute("aria-label", "compare run " + runId);
        box.dataset.run = runId;
        box.dataset.session = text(row, "session_id");
        box.dataset.time = text(row, "timestamp");
        box.addEventListener("change", update);
        boxes.push(box);
        cell.appendChild(box);
      }
      row.insertBefore(cell, row.firstChild);
    });

    function set(a, href, title) {
      if (href) { a.href = href; } else { a.removeAttribute("href"); }
      a.title = title;
      a.setAttribute("aria-disabled", href ? "false" : "true");
    }
    function update() {
      var ticked = boxes.filter(function (box) { return box.checked; });
      if (ticked.length !== 2) {
        hint.textContent = ticked.length > 2 ? "(" + ticked.length + " ticked: tick two)" : "";
        set(runs, "", "tick two runs");
        set(sessions, "", "tick two runs");
        return;
      }
      hint.textContent = "";
      // A: the older of the two (ISO timestamps sort as text); the table may be sorted any way.
      ticked.sort(function (x, y) { return x.dataset.time < y.dataset.time ? -1 : 1; });
      var a = ticked[0].dataset, b = ticked[1].dataset;
      set(runs, base + "/compare_runs?" + new URLSearchParams({ run_a: a.run, run_b: b.run }),
          "run " + a.run + " (A) against run " + b.run + " (B)");
      if (!a.session || !b.session) {
        set(sessions, "", "the session_id column is not shown");
      } else if (a.session === b.session) {
        set(sessions, "", "both runs are of session " + a.session);
      } else {
        set(sessions, base + "/compare_sessions?" + new URLSearchParams(
          { session_a: a.session, session_b: b.session }),
          "session " + a.session + " (A) against session " + b.session + " (B)");
      }
    }
    update();
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setup);
  } else {
    setup();
  }
})();
