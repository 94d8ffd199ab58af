// The admin single-page app: one shell (index.html), a page module per section, client-side
// navigation with real URLs (/admin/<page>, reloadable and linkable).
import { signOut } from "./api.js";
import { clear, errorBox, h } from "./ui.js";
import * as adapters from "./pages/adapters.js";
import * as billing from "./pages/billing.js";
import * as keys from "./pages/keys.js";
import * as slo from "./pages/slo.js";
import * as tenants from "./pages/tenants.js";
import * as usage from "./pages/usage.js";

const PAGES = { tenants, keys, adapters, usage, billing, slo };
const main = document.getElementById("main");
let current = null; // AbortController of the page on screen: polling stops when it is left

export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render();
}

async function render() {
  if (current) current.abort();
  current = new AbortController();
  const parts = location.pathname.replace(/\/+$/, "").split("/").filter(Boolean); // ["admin", page, arg]
  const name = parts[1] || "tenants";
  const page = PAGES[name] || tenants;
  for (const a of document.querySelectorAll(".nav a")) {
    if (a.dataset.page === name) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  clear(main, h("p", { class: "muted" }, "Loading…"));
  const ctx = {
    arg: parts[2] ? decodeURIComponent(parts[2]) : null,
    params: new URLSearchParams(location.search),
    signal: current.signal,
    navigate,
    /** Change query parameters of this page, keeping the others. */
    setParams(changes) {
      const p = new URLSearchParams(location.search);
      for (const [k, v] of Object.entries(changes)) {
        if (v === null || v === undefined || v === "") p.delete(k);
        else p.set(k, v);
      }
      const qs = p.toString();
      navigate(`${location.pathname}${qs ? `?${qs}` : ""}`, { replace: true });
    },
  };
  try {
    await page.render(main, ctx);
  } catch (err) {
    if (!ctx.signal.aborted) clear(main, h("h1", {}, page.title || "Error"), errorBox(err));
  }
  if (!ctx.signal.aborted) document.title = `${page.title} · Tessera admin`;
}

document.addEventListener("click", (event) => {
  const a = event.target.closest("a[data-nav]");
  if (!a || event.defaultPrevented || event.button !== 0 || event.metaKey || event.ctrlKey || event.shiftKey) return;
  event.preventDefault();
  navigate(a.getAttribute("href"));
  main.focus({ preventScroll: false });
});
window.addEventListener("popstate", render);
document.getElementById("sign-out").addEventListener("click", signOut);
render();
