// Keeps the numbers of the page fresh by polling this server's own JSON endpoints, and remembers
// the action token for the tab. Values are written with textContent only: never as HTML.
(function () {
  "use strict";
  var TOKEN_KEY = "outbox-dashboard-token";
  var POLL_MS = 5000;

  function age(s) {
    if (s === null || s === undefined || isNaN(s) || s < 0) return "";
    s = Math.round(s);
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + String(s % 60).padStart(2, "0") + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }
  function num(v) {
    if (v === null || v === undefined) return "";
    if (typeof v !== "number") return String(v);
    return String(v).replace(/\B(?=(\d{3})+(?!\d))/g, "\u202f");
  }
  function apply(values) {
    var cells = document.querySelectorAll("[data-k]");
    for (var i = 0; i < cells.length; i++) {
      var k = cells[i].getAttribute("data-k");
      if (!Object.prototype.hasOwnProperty.call(values, k)) continue;
      var v = values[k];
      cells[i].textContent = cells[i].getAttribute("data-fmt") === "age" ? age(v) : num(v);
    }
    var r = document.getElementById("refreshed");
    if (r) r.textContent = "refreshed " + new Date().toLocaleTimeString();
  }
  function poll(url, flatten) {
    fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (res) { return res.ok ? res.json() : null; })
      .then(function (doc) { if (doc) apply(flatten(doc)); })
      .catch(function () { /* the next poll tries again */ });
  }
  function statsValues(doc) {
    var out = {};
    (doc.stats || []).forEach(function (row) {
      Object.keys(row).forEach(function (f) { out["t|" + row.subscription + "|" + row.topic + "|" + f] = row[f]; });
    });
    (doc.subscriptions || []).forEach(function (row) {
      Object.keys(row).forEach(function (f) { out["s|" + row.name + "|" + f] = row[f]; });
    });
    return out;
  }
  function healthValues(doc) {
    var out = {};
    (doc.checks || []).forEach(function (row, i) {
      out["h|" + i + "|status"] = row.status;
      out["h|" + i + "|value"] = row.value;
      out["h|" + i + "|message"] = row.message || "";
    });
    return out;
  }

  document.addEventListener("DOMContentLoaded", function () {
    var page = document.body.getAttribute("data-page");
    var sources = { overview: ["/api/stats", statsValues], health: ["/api/health", healthValues] };
    var src = sources[page];
    if (src) setInterval(function () { poll(src[0], src[1]); }, POLL_MS);

    // The action token is typed once in the header box and kept in this tab's sessionStorage
    // only; each action form gets a copy when it is submitted.
    var box = document.getElementById("action-token");
    if (box) {
      try { box.value = window.sessionStorage.getItem(TOKEN_KEY) || ""; } catch (e) { /* private mode */ }
      box.addEventListener("change", function () {
        try { window.sessionStorage.setItem(TOKEN_KEY, box.value); } catch (e) { /* private mode */ }
      });
    }
    var forms = document.querySelectorAll("form.action");
    for (var j = 0; j < forms.length; j++) {
      forms[j].addEventListener("submit", function (ev) {
        var t = ev.target.querySelector("input.token");
        if (t && box) {
          t.value = box.value;
          try { window.sessionStorage.setItem(TOKEN_KEY, box.value); } catch (e) { /* private mode */ }
        }
      });
    }
    var jump = document.getElementById("jump-form");
    if (jump) jump.addEventListener("submit", function (ev) {
      var id = (document.getElementById("jump-id").value || "").trim();
      if (/^[0-9]+$/.test(id)) { ev.preventDefault(); window.location.href = "/events/" + id; }
    });
  });
})();
