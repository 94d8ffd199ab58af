// SLOs: per tenant, error budget remaining and burn rates of availability, TTFT and TPOT, and
// which alerts fire (GET /admin/v1/slo). sloEditor() is the objectives form of a tenant's page.
import { api, ApiFailure } from "../api.js";
import { busy, clear, emptyState, field, h, toast, unavailable } from "../ui.js";

export const title = "SLOs";

const SLOS = [
  ["availability", "Availability"],
  ["ttft", "Time to first token"],
  ["tpot", "Time per output token"],
];
const SLO_NAMES = Object.fromEntries(SLOS);
const WINDOWS = ["5m", "1h", "6h", "1d", "3d"];
const TTFT_BOUNDS = [25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2000, 3000, 5000, 10000, 20000, 60000];
const TPOT_BOUNDS = [5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000];

function pct(x, digits = 1) {
  return x === null || x === undefined ? "—" : `${(x * 100).toFixed(digits)}%`;
}

function burn(x) {
  if (x === null || x === undefined) return h("span", { class: "muted", title: "no request in this window" }, "—");
  const cls = x >= 14.4 ? "bad" : x >= 1 ? "warn" : "good";
  return h("span", { class: `burn ${cls}` }, `${x.toFixed(x >= 10 ? 0 : 2)}×`);
}

function objectiveText(name, s) {
  if (name === "availability") return `${pct(s.target, 2)} of requests succeed`;
  return `${pct(s.target, 0)} under ${s.threshold_ms} ms`;
}

function budgetBar(remaining) {
  if (remaining === null || remaining === undefined) return h("span", { class: "muted" }, "no traffic yet");
  const clamped = Math.max(0, Math.min(1, remaining));
  const cls = remaining <= 0 ? "bad" : remaining < 0.25 ? "warn" : "good";
  return h("div", { class: "budget" },
    h("meter", { min: 0, max: 1, low: 0.25, high: 0.5, optimum: 1, value: clamped, "aria-label": "Error budget remaining" }),
    h("span", { class: `budget-text ${cls}` }, remaining < 0 ? `overspent by ${pct(-remaining, 0)}` : `${pct(remaining, 0)} left`));
}

export async function render(main, ctx) {
  let doc;
  try {
    doc = await api("GET", "/slo");
  } catch (err) {
    if (err instanceof ApiFailure && err.unavailable) {
      clear(main, h("h1", {}, "SLOs"), unavailable("SLO reporting"));
      return;
    }
    throw err;
  }
  const only = ctx.params.get("tenant");
  const tenants = doc.tenants.filter((t) => !only || t.tenant === only);
  const firing = tenants.flatMap((t) => t.alerts.filter((a) => a.state === "firing").map((a) => ({ ...a, tenant: t.tenant })));
  const sourceNote = doc.source === "prometheus"
    ? "Burn rates from Prometheus recording rules; alerts are Prometheus's active alerts."
    : "Burn rates computed from recorded usage events (no Prometheus configured or reachable).";
  const body = [
    h("h1", {}, "SLOs"),
    h("p", { class: "muted" }, sourceNote, tenants[0]?.source_error ? ` ${tenants[0].source_error}.` : ""),
    h("section", { class: "card", "aria-labelledby": "alerts-title" }, h("h2", { id: "alerts-title" }, "Firing alerts"),
      firing.length
        ? h("ul", { class: "alerts" }, firing.map((a) => h("li", { class: `alert ${a.severity}` },
          h("strong", {}, `${a.tenant}: ${SLO_NAMES[a.slo] || a.slo} error budget burning over ${a.burn_rate_threshold}× the sustainable rate`),
          ` (${a.severity}; over the last ${a.long_window} and ${a.short_window})`)))
        : h("p", { class: "ok-text" }, "No alert is firing. Every tenant is within its error budget burn limits.")),
  ];
  if (!tenants.length) {
    body.push(emptyState("No tenants to report on", "Create a tenant and send it traffic; its SLO status appears here."));
  }
  for (const t of tenants) body.push(tenantCard(t));
  clear(main, body);
}

function tenantCard(t) {
  const rows = SLOS.map(([name, label]) => {
    const s = t.status[name];
    if (!s) return null;
    return h("tr", {},
      h("th", { scope: "row", "data-label": "SLO" }, label),
      h("td", { "data-label": "Objective" }, objectiveText(name, s)),
      h("td", { "data-label": "Error budget (30 days)" }, budgetBar(s.error_budget_remaining)),
      WINDOWS.map((w) => h("td", { "data-label": `Burn ${w}` }, burn(s.burn_rates ? s.burn_rates[w] : null))));
  });
  const firing = t.alerts.filter((a) => a.state === "firing");
  return h("section", { class: "card", "aria-label": `SLOs of ${t.tenant}`, dataset: { tenant: t.tenant } },
    h("div", { class: "title-row" },
      h("h2", {}, h("a", { href: `/admin/tenants/${encodeURIComponent(t.tenant)}`, "data-nav": true }, t.tenant),
        " ", h("span", { class: "muted" }, `plan ${t.plan}`)),
      firing.length ? h("span", { class: "badge rejected" }, `${firing.length} firing`) : h("span", { class: "badge ready" }, "healthy")),
    h("div", { class: "table-wrap" }, h("table", { class: "stack" },
      h("thead", {}, h("tr", {}, ["SLO", "Objective", "Error budget (30 days)", ...WINDOWS.map((w) => `Burn ${w}`)].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, rows))));
}

function boundsSelect(bounds, value) {
  const select = h("select", {});
  for (const b of bounds) select.append(h("option", { value: String(b) }, `${b} ms`));
  select.value = String(value);
  return select;
}

function shareInput(value) {
  return h("input", { type: "number", min: 0.5, max: 0.99999, step: "any", value: value, inputmode: "decimal" });
}

function flatten(o) {
  return {
    availability_target: o.availability.target, ttft_threshold_ms: o.ttft.threshold_ms, ttft_target: o.ttft.target,
    tpot_threshold_ms: o.tpot.threshold_ms, tpot_target: o.tpot.target,
  };
}

/** The objectives form of one tenant (PATCH /admin/v1/tenants/{t}/slo). Throws ApiFailure
 * (unavailable) when the server has no SLO API. */
export async function sloEditor(tenant) {
  const enc = encodeURIComponent(tenant);
  const doc = await api("GET", `/tenants/${enc}/slo`);
  const o = doc.objectives;
  const shown = flatten(o);
  const avail = shareInput(o.availability.target);
  const ttftMs = boundsSelect(TTFT_BOUNDS, o.ttft.threshold_ms);
  const ttftT = shareInput(o.ttft.target);
  const tpotMs = boundsSelect(TPOT_BOUNDS, o.tpot.threshold_ms);
  const tpotT = shareInput(o.tpot.target);
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button primary" }, "Save objectives");
  const form = h("form", { class: "grid-form" },
    h("p", { class: "hint wide" }, `Targets are shares of requests (0.995 = 99.5%) over ${o.window_days} days. Values not overridden come from plan ${doc.plan}.`),
    field("Availability target", avail, "Share of requests without a server error."),
    field("TTFT threshold", ttftMs),
    field("TTFT target", ttftT, "Share of requests whose first token comes under the threshold."),
    field("TPOT threshold", tpotMs),
    field("TPOT target", tpotT, "Share of requests whose time per output token stays under the threshold."),
    h("div", { class: "actions" }, submit), errors);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    busy(submit, async () => {
      const share = (input, label) => {
        const v = Number(input.value);
        if (!(v > 0 && v < 1)) throw new Error(`${label}: enter a share between 0 and 1, such as 0.99.`);
        return v;
      };
      const wanted = {
        availability_target: share(avail, "Availability target"),
        ttft_threshold_ms: Number(ttftMs.value), ttft_target: share(ttftT, "TTFT target"),
        tpot_threshold_ms: Number(tpotMs.value), tpot_target: share(tpotT, "TPOT target"),
      };
      // Only what changed becomes this tenant's own value; the rest keeps following its plan.
      const body = Object.fromEntries(Object.entries(wanted).filter(([k, v]) => v !== shown[k]));
      if (!Object.keys(body).length) {
        toast("Nothing changed.");
        return;
      }
      const saved = await api("PATCH", `/tenants/${enc}/slo`, body);
      Object.assign(shown, flatten(saved.objectives));
      toast(`SLO objectives of ${tenant} saved.`);
    }, errors);
  });
  return form;
}
