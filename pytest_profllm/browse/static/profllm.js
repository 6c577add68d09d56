// Draws every chart of a prepared page: the specs (Vega-Lite, data inline) are in the page's
// <script id="profllm-charts">, keyed by the id of the element each goes in. A chart that
// drew sets data-drawn="1" on its element (the browser test waits for it).
(function () {
  "use strict";
  function draw() {
    var holder = document.getElementById("profllm-charts");
    if (!holder || typeof vegaEmbed === "undefined") { return; }
    var charts = JSON.parse(holder.textContent || "{}");
    Object.keys(charts).forEach(function (id) {
      var element = document.getElementById(id);
      if (!element) { return; }
      vegaEmbed(element, charts[id], { actions: { export: true, source: false, compiled: false, editor: false }, renderer: "svg" })
        .then(function () { element.setAttribute("data-drawn", "1"); })
        .catch(function (error) {
          element.setAttribute("data-error", String(error));
          element.textContent = "This chart could not be drawn: " + error;
        });
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
