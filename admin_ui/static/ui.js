// Small DOM helpers shared by the pages. Text always goes in as text nodes (never innerHTML),
// so names and messages from the server cannot inject markup.
import { api } from "./api.js";

/** h("button", {class: "button", onclick: fn}, "Save") */
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k in el && typeof v !== "string") el[k] = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

let uid = 0;
export function newId(prefix = "f") {
  uid += 1;
  return `${prefix}-${uid}`;
}

/** A labelled form field: field("Name", h("input", {...}), "hint"). */
export function field(label, control, hint) {
  if (!control.id) control.id = newId();
  const parts = [h("label", { for: control.id }, label), control];
  if (hint) {
    const hintId = newId("hint");
    control.setAttribute("aria-describedby", hintId);
    parts.push(h("p", { class: "hint", id: hintId }, hint));
  }
  return h("div", { class: "field" }, parts);
}

export function toast(message, kind = "ok") {
  const box = document.getElementById("toasts");
  const t = h("div", { class: `toast ${kind}` }, message);
  // Only the latest message stays: a pile of old ones would hide the page.
  box.replaceChildren(t);
  setTimeout(() => t.remove(), 5000);
}

export function errorBox(err) {
  return h("div", { class: "notice error", role: "alert" }, err && err.message ? err.message : String(err));
}

export function emptyState(title, text, action) {
  return h("div", { class: "empty" }, h("h3", {}, title), h("p", {}, text), action || null);
}

export function unavailable(what) {
  return h("div", { class: "notice info", role: "status" },
    h("strong", {}, `${what} is not available on this server yet. `),
    "This part of the platform has not been deployed here; the page will work once it is.");
}

export function badge(status) {
  return h("span", { class: `badge ${status}` }, status);
}

/** Run an async action from a button: disables it while running, shows the error inline. */
export async function busy(button, fn, errorTarget) {
  const label = button.textContent;
  button.disabled = true;
  if (errorTarget) errorTarget.replaceChildren();
  try {
    return await fn();
  } catch (err) {
    if (errorTarget) errorTarget.append(errorBox(err));
    else toast(err.message, "error");
    return undefined;
  } finally {
    button.disabled = false;
    button.textContent = label;
  }
}

export const fmt = {
  int(n) {
    if (n === null || n === undefined) return "—";
    return (typeof n === "bigint" ? n : Number(n)).toLocaleString("en-US");
  },
  limit(n) {
    return n === null || n === undefined ? "unlimited" : Number(n).toLocaleString("en-US");
  },
  bytes(n) {
    if (n === null || n === undefined) return "—";
    const units = ["B", "KB", "MB", "GB"];
    let v = n;
    let i = 0;
    while (v >= 1024 && i < units.length - 1) {
      v /= 1024;
      i += 1;
    }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  },
  date(iso) {
    if (!iso) return "—";
    const d = new Date(iso);
    return d.toLocaleString("en-GB", { year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
  },
  /** Integer micro-units of currency -> "12.345678 USD" trimmed to cents where exact. */
  money(micros, currency = "USD") {
    if (micros === null || micros === undefined) return "—";
    const v = Number(micros) / 1e6;
    const digits = Math.abs(v) >= 1 || v === 0 ? 2 : 6;
    return `${v.toLocaleString("en-US", { minimumFractionDigits: digits, maximumFractionDigits: digits })} ${currency}`;
  },
  /** Exact: integer micro-units (Number, BigInt or digit string) -> "1,234.567800 USD"; trailing
   * zeros trimmed down to `minDecimals` (6 keeps every micro-unit visible). */
  micros(micros, currency = "USD", minDecimals = 6) {
    return micros === null || micros === undefined ? "—" : `${decimal(micros, 6, minDecimals)} ${currency}`;
  },
  /** Exact: integer pico-units (1e-12) -> "0.00000345 USD", at least `minDecimals` decimals. */
  picos(picos, currency = "USD", minDecimals = 6) {
    return picos === null || picos === undefined ? "—" : `${decimal(picos, 12, minDecimals)} ${currency}`;
  },
};

/** An integer amount in units of 10^-scale as exact decimal text, by BigInt arithmetic (never
 * through a float, which loses digits past 2^53): decimal(12345678n, 6, 2) -> "12.345678". */
export function decimal(value, scale, minDecimals = 0) {
  let v = BigInt(value);
  const sign = v < 0n ? "-" : "";
  if (v < 0n) v = -v;
  const unit = 10n ** BigInt(scale);
  let frac = (v % unit).toString().padStart(scale, "0").replace(/0+$/, "");
  frac = frac.padEnd(Math.min(minDecimals, scale), "0");
  return `${sign}${(v / unit).toLocaleString("en-US")}${frac ? `.${frac}` : ""}`;
}

/** Picos -> micro-units, rounded half up: the platform's one rounding rule (amounts are >= 0). */
export function roundPicos(picos) {
  return (BigInt(picos) + 500000n) / 1000000n;
}

/** "2.5" (currency units, at most 6 decimals) -> 2500000n micro-units; null when not such a number. */
export function parseMicros(text) {
  const s = String(text).trim().replace(/,/g, "");
  const m = s.match(/^(\d*)(?:\.(\d{0,6}))?$/);
  if (!m || !/\d/.test(s)) return null;
  return BigInt(m[1] || "0") * 1000000n + BigInt((m[2] || "").padEnd(6, "0"));
}

let tenantsCache = null;
const LAST_TENANT = "tessera.admin.tenant";

/** The tenant the admin last worked on: the Keys and Adapters pages open on it. */
export function rememberTenant(name) {
  sessionStorage.setItem(LAST_TENANT, name);
}

export async function listTenants(fresh = false) {
  if (!tenantsCache || fresh) tenantsCache = (await api("GET", "/tenants")).data;
  return tenantsCache;
}

export function forgetTenants() {
  tenantsCache = null;
}

/** A labelled tenant <select>; onChange(name). Resolves to {element, value}. */
export async function tenantPicker(current, onChange, { allowAll = false } = {}) {
  const tenants = await listTenants();
  const select = h("select", { name: "tenant" });
  if (allowAll) select.append(h("option", { value: "" }, "All tenants"));
  for (const t of tenants) {
    select.append(h("option", { value: t.name }, t.status === "active" ? t.name : `${t.name} (${t.status})`));
  }
  const known = (n) => n && tenants.some((t) => t.name === n);
  const remembered = sessionStorage.getItem(LAST_TENANT);
  const value = known(current) ? current : allowAll ? "" : known(remembered) ? remembered : tenants[0]?.name || "";
  select.value = value;
  if (value) rememberTenant(value);
  select.addEventListener("change", () => onChange(select.value));
  return { element: field("Tenant", select), value, empty: tenants.length === 0 };
}

/** The tenant picker of a page whose items (`title`: "Adapters", "Keys") belong to a tenant. With
 * no tenant yet, `main` shows the page's heading and a "create a tenant first" notice with a link
 * to Tenants instead, and this resolves null. */
export async function tenantPickerOrNotice(main, title, current, onChange) {
  const picker = await tenantPicker(current, onChange);
  if (picker.empty) {
    clear(main, h("h1", {}, title), emptyState("No tenants yet", `${title} belong to a tenant. Create a tenant first.`,
      h("a", { href: "/admin/tenants", "data-nav": true, class: "button primary" }, "Go to Tenants")));
    return null;
  }
  return picker;
}

/** A dialog asking to confirm a destructive action; resolves true/false. */
export function confirmDialog(title, text, confirmLabel) {
  return new Promise((resolve) => {
    const dialog = h("dialog", { class: "dialog", "aria-labelledby": "dialog-title" },
      h("h2", { id: "dialog-title" }, title),
      h("p", {}, text));
    const cancel = h("button", { type: "button", class: "button", onclick: () => dialog.close("cancel") }, "Cancel");
    const ok = h("button", { type: "button", class: "button danger", onclick: () => dialog.close("ok") }, confirmLabel);
    dialog.append(h("div", { class: "actions" }, cancel, ok));
    dialog.addEventListener("close", () => {
      dialog.remove();
      resolve(dialog.returnValue === "ok");
    });
    document.body.append(dialog);
    dialog.showModal();
    cancel.focus();
  });
}
