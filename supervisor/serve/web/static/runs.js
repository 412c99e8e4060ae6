/* The runs index (supervisor/serve/web/pages.py, GET /): refreshes its list in place every
 * data-refresh seconds while "auto-refresh" is ticked (issue 37: the index was static), keeping the
 * runs ticked for comparison, and says when it last did. The sort and the filters are the page's
 * own query parameters: this fetches the same address. Plain script; without it the page is whole. */
"use strict";
(function () {
  const list = document.getElementById("runs-list"), auto = document.getElementById("auto");
  const updated = document.getElementById("updated");
  if (!list || !auto || !updated) return;
  const KEY = "thermowatch.index.auto";
  const tw = window.thermowatchIndex = {refreshes: 0, errors: []};
  auto.checked = sessionStorage.getItem(KEY) !== "0";
  auto.addEventListener("change", () => { sessionStorage.setItem(KEY, auto.checked ? "1" : "0"); });
  const stamp = (at) => { updated.textContent = `updated ${at.toLocaleTimeString()}`; updated.dataset.at = at.toISOString(); };
  stamp(new Date(updated.dataset.at));

  tw.tick = async () => {  // one refresh (the tests call it rather than wait for the timer)
    try {
      const r = await fetch(location.href, {credentials: "same-origin", headers: {accept: "text/html"}});
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      const fresh = new DOMParser().parseFromString(await r.text(), "text/html").getElementById("runs-list");
      if (!fresh) throw new Error("no runs list in the page");
      const ticked = new Set([...list.querySelectorAll("input[name=run]:checked")].map((x) => x.value));
      list.replaceChildren(...fresh.childNodes);  // our own server-rendered, escaped markup
      list.querySelectorAll("input[name=run]").forEach((x) => { x.checked = ticked.has(x.value); });
      tw.refreshes++;
      stamp(new Date());
    } catch (err) {
      tw.errors.push(String(err.message || err));
      updated.textContent = `could not refresh (${err.message || err}); ${updated.textContent}`;
    }
  };
  const every = 1000 * Number(list.dataset.refresh || 15);
  setInterval(() => { if (auto.checked && document.visibilityState === "visible") tw.tick(); }, every);
})();
