// The landing table: a box on each run to tick two, then one click compares the two runs
// (the compare_runs query) or their sessions (compare_sessions). It only builds links to the
// database's read-only canned queries: nothing is written. The older run is A, the newer B.
// Ticks are kept in the tab's sessionStorage, so the two runs may lie on different pages of
// the table (or under different filters); following a compare link clears them.
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
    var key = "profllm-compare:" + base;
    var kept = [];  // {run, session, time} of every ticked run, on any page
    try { kept = JSON.parse(window.sessionStorage.getItem(key) || "[]"); } catch (e) { kept = []; }
    if (!Array.isArray(kept)) { kept = []; }
    function save() {
      try { window.sessionStorage.setItem(key, JSON.stringify(kept)); } catch (e) { /* off */ }
    }
    function tickedOf(runId) {
      return kept.some(function (k) { return k.run === runId; });
    }
    function changed(event) {
      var box = event.target;
      kept = kept.filter(function (k) { return k.run !== box.dataset.run; });
      if (box.checked) {
        kept.push({ run: box.dataset.run, session: box.dataset.session, time: box.dataset.time });
      }
      save();
      update();
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
        box.checked = tickedOf(runId);
        box.addEventListener("change", changed);
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
    var clear = document.createElement("a");
    clear.href = "#";
    clear.textContent = "clear";
    clear.addEventListener("click", function (event) {
      event.preventDefault();
      kept = [];
      save();
      boxes.forEach(function (box) { box.checked = false; });
      update();
    });
    function forget() {
      try { window.sessionStorage.removeItem(key); } catch (e) { /* off */ }
    }
    runs.addEventListener("click", forget);
    sessions.addEventListener("click", forget);
    function update() {
      var here = boxes.filter(function (box) { return box.checked; }).length;
      var elsewhere = kept.length - here;
      var away = elsewhere > 0 ? ", " + elsewhere + " on another page" : "";
      if (clear.parentNode) { clear.parentNode.removeChild(clear); }
      if (kept.length) { hint.parentNode.appendChild(clear); }
      if (kept.length !== 2) {
        hint.textContent = kept.length > 2 ? "(" + kept.length + " ticked" + away + ": tick two) "
          : kept.length === 1 ? "(1 ticked" + away + ") " : "";
        set(runs, "", "tick two runs");
        set(sessions, "", "tick two runs");
        return;
      }
      hint.textContent = elsewhere > 0 ? "(2 ticked" + away + ") " : "";
      // A: the older of the two (ISO timestamps sort as text); the table may be sorted any way.
      var ticked = kept.slice().sort(function (x, y) { return x.time < y.time ? -1 : 1; });
      var a = ticked[0], b = ticked[1];
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
