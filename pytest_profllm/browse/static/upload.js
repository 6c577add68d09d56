// The upload page: files dropped (or chosen) are sent one at a time, each as the body of its
// own POST, with a progress bar per file and a count for the batch; each row then says what
// the server did with its file (loaded, updated, duplicate, refused and why).
(function () {
  "use strict";
  var zone = document.getElementById("profllm-drop");
  if (!zone) { return; }
  var input = document.getElementById("profllm-files");
  var body = document.querySelector("#profllm-results tbody");
  var batch = document.getElementById("profllm-batch");
  var queue = [];
  var done = 0, total = 0, busy = false;
  var counts = {};

  function row(file) {
    var tr = document.createElement("tr");
    var name = document.createElement("td"); name.textContent = file.name;
    var bar = document.createElement("progress"); bar.max = 100; bar.value = 0;
    var progress = document.createElement("td"); progress.appendChild(bar);
    var outcome = document.createElement("td"); outcome.textContent = "waiting";
    var why = document.createElement("td");
    tr.append(name, progress, outcome, why);
    body.appendChild(tr);
    return { bar: bar, outcome: outcome, why: why, tr: tr };
  }

  function show() {
    var parts = Object.keys(counts).map(function (k) { return counts[k] + " " + k; });
    batch.textContent = done + " of " + total + " file(s) sent" + (parts.length ? ": " + parts.join(", ") : "");
    batch.dataset.done = String(done === total && total > 0);
  }

  function next() {
    if (busy || !queue.length) { return; }
    busy = true;
    var item = queue.shift();
    var request = new XMLHttpRequest();
    request.open("POST", zone.dataset.url);
    request.setRequestHeader("x-csrftoken", zone.dataset.csrftoken);
    request.setRequestHeader("x-profllm-filename", encodeURIComponent(item.file.name));
    request.setRequestHeader("content-type", "application/octet-stream");
    request.upload.onprogress = function (event) {
      if (event.lengthComputable) { item.ui.bar.value = Math.round(100 * event.loaded / event.total); }
    };
    request.onloadend = function () {
      var answer;
      try { answer = JSON.parse(request.responseText); } catch (e) { answer = { outcome: "refused", reason: "HTTP " + request.status }; }
      item.ui.bar.value = 100;
      item.ui.outcome.textContent = answer.outcome;
      item.ui.why.textContent = answer.reason || "";
      item.ui.tr.className = "profllm-upload-" + answer.outcome;
      counts[answer.outcome] = (counts[answer.outcome] || 0) + 1;
      done += 1; busy = false; show(); next();
    };
    item.ui.outcome.textContent = "sending";
    request.send(item.file);
  }

  function add(files) {
    for (var i = 0; i < files.length; i++) {
      queue.push({ file: files[i], ui: row(files[i]) });
      total += 1;
    }
    show(); next();
  }

  zone.addEventListener("dragover", function (event) { event.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", function () { zone.classList.remove("over"); });
  zone.addEventListener("drop", function (event) {
    event.preventDefault(); zone.classList.remove("over");
    add(event.dataTransfer.files);
  });
  input.addEventListener("change", function () { add(input.files); input.value = ""; });
})();
