// Usage: tokens and cost over time, per tenant, per adapter or per priority class, for a period
// (GET /admin/v1/tenants/{tenant}/usage/buckets). Charts first; the same numbers in a table below.
import { api, ApiFailure } from "../api.js";
import { clear, emptyState, field, fmt, h, listTenants, unavailable } from "../ui.js";

export const title = "Usage";

const PERIODS = {
  "24h": { label: "Last 24 hours", seconds: 86400, width: "1h" },
  "7d": { label: "Last 7 days", seconds: 7 * 86400, width: "1d" },
  "30d": { label: "Last 30 days", seconds: 30 * 86400, width: "1d" },
};
const VIEWS = { tenant: "Tenant", adapter: "Adapter", priority: "Priority class" };
const COLORS = ["#2563eb", "#db2777", "#16a34a", "#ea580c", "#7c3aed", "#0891b2", "#ca8a04", "#dc2626", "#4b5563", "#65a30d"];

function select(name, options, value) {
  const s = h("select", { name });
  for (const [v, label] of Object.entries(options)) s.append(h("option", { value: v }, label));
  s.value = value;
  return s;
}

function requests(r) {
  return r.num_requests ?? r.num_model_requests ?? 0;
}

/** The result's cost in micro-units; null when some of its tokens have no price (not priced). */
function cost(r) {
  if (r.cost_micros !== undefined) return r.cost_micros;
  return r.cost_micro_units ?? r.cost ?? 0;
}

function hasCost(pages) {
  // Cost shows once some usage has a price; until then say so, never "0.00 USD".
  return pages.some(({ page }) => (page.data || []).some((b) => (b.results || []).some((r) => {
    const c = r.cost_micros !== undefined ? r.cost_micros : r.cost_micro_units ?? r.cost;
    return c !== undefined && c !== null;
  })));
}

function groupKey(r, view) {
  if (view === "adapter") return r.adapter ?? r.model ?? "base model";
  if (view === "priority") return r.priority ?? "unknown";
  return null;
}

async function buckets(tenant, params) {
  const qs = new URLSearchParams(params);
  return api("GET", `/tenants/${encodeURIComponent(tenant)}/usage/buckets?${qs}`);
}

/** {bucketStarts: [...], series: Map(label -> {tokens[], input[], output[], cost[], requests[]})} */
function collect(pages, view, width, start, end) {
  // Every bucket of the period is on the time axis, empty ones too, so gaps read as time.
  const step = width === "1h" ? 3600 : 86400;
  const starts = new Set();
  for (let t = start; t < end; t += step) starts.add(t);
  const series = new Map();
  for (const { page } of pages) {
    for (const b of page.data || []) starts.add(b.start_time);
  }
  const bucketStarts = [...starts].sort((a, b) => a - b);
  const index = new Map(bucketStarts.map((s, i) => [s, i]));
  const zeros = () => bucketStarts.map(() => 0);
  for (const { tenant, page, prefix } of pages) {
    for (const b of page.data || []) {
      for (const r of b.results || []) {
        const key = view === "tenant" ? tenant : `${prefix}${groupKey(r, view)}`;
        if (!series.has(key)) series.set(key, { input: zeros(), output: zeros(), cost: zeros(), requests: zeros(), unpriced: zeros() });
        const s = series.get(key);
        const i = index.get(b.start_time);
        s.input[i] += r.input_tokens || 0;
        s.output[i] += r.output_tokens || 0;
        const c = cost(r);
        if (c === null) s.unpriced[i] += 1; // a bucket with unpriced tokens has no cost, not 0
        else s.cost[i] += Number(c);
        s.requests[i] += requests(r);
      }
    }
  }
  const labels = bucketStarts.map((t) => {
    const d = new Date(t * 1000);
    return width === "1h"
      ? d.toLocaleString("en-GB", { day: "numeric", month: "short", hour: "2-digit", minute: "2-digit" })
      : d.toLocaleDateString("en-GB", { day: "numeric", month: "short" });
  });
  return { labels, series };
}

function chartBox(id, heading, desc) {
  const canvas = h("canvas", { id, role: "img", "aria-label": desc });
  return { canvas, element: h("figure", { class: "chart" }, h("figcaption", {}, heading), h("div", { class: "chart-area" }, canvas)) };
}

function drawChart(canvas, labels, datasets, yTitle) {
  if (!window.Chart) return false;
  const existing = window.Chart.getChart(canvas);
  if (existing) existing.destroy();
  new window.Chart(canvas, {
    type: "bar",
    data: { labels, datasets },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      animation: false,
      interaction: { mode: "index", intersect: false },
      plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
      scales: {
        x: { stacked: true, ticks: { maxRotation: 0, autoSkip: true, autoSkipPadding: 12 } },
        y: { stacked: true, beginAtZero: true, title: { display: true, text: yTitle } },
      },
    },
  });
  return true;
}

export async function render(main, ctx) {
  const tenants = await listTenants();
  const p = ctx.params;
  const periodKey = PERIODS[p.get("period")] ? p.get("period") : "24h";
  const view = VIEWS[p.get("by")] ? p.get("by") : "tenant";
  const tenant = tenants.some((t) => t.name === p.get("tenant")) ? p.get("tenant") : "";

  const periodSel = select("period", Object.fromEntries(Object.entries(PERIODS).map(([k, v]) => [k, v.label])), periodKey);
  const viewSel = select("by", VIEWS, view);
  const tenantOpts = { "": "All tenants", ...Object.fromEntries(tenants.map((t) => [t.name, t.name])) };
  const tenantSel = select("tenant", tenantOpts, tenant);
  periodSel.addEventListener("change", () => ctx.setParams({ period: periodSel.value }));
  viewSel.addEventListener("change", () => ctx.setParams({ by: viewSel.value }));
  tenantSel.addEventListener("change", () => ctx.setParams({ tenant: tenantSel.value }));
  const filters = h("form", { class: "toolbar filters", "aria-label": "Usage filters", onsubmit: (e) => e.preventDefault() },
    field("Period", periodSel), field("Break down by", viewSel), field("Tenant", tenantSel));

  if (!tenants.length) {
    clear(main, h("h1", {}, "Usage"), emptyState("No tenants yet", "Usage appears here once a tenant sends requests. Create a tenant and issue it a key first.",
      h("a", { href: "/admin/tenants", "data-nav": true, class: "button primary" }, "Go to Tenants")));
    return;
  }

  const period = PERIODS[periodKey];
  const step = period.width === "1h" ? 3600 : 86400; // day buckets start at midnight UTC
  const end = Math.ceil(Date.now() / 1000 / step) * step;
  const start = end - period.seconds;
  const chosen = tenant ? [tenant] : tenants.map((t) => t.name);
  const params = { start_time: start, end_time: end, bucket_width: period.width };
  if (view !== "tenant") params.group_by = view;
  let pages;
  try {
    pages = await Promise.all(chosen.map(async (t) => ({
      tenant: t, prefix: !tenant && view === "adapter" ? `${t}/` : "", page: await buckets(t, params),
    })));
  } catch (err) {
    if (err instanceof ApiFailure && err.unavailable) {
      clear(main, h("h1", {}, "Usage"), filters, unavailable("Usage reporting"));
      return;
    }
    throw err;
  }
  if (ctx.signal.aborted) return;
  const { labels, series } = collect(pages, view, period.width, start, end);
  const priced = hasCost(pages);
  const names = [...series.keys()].sort();
  const total = (s, k) => s[k].reduce((a, b) => a + b, 0);
  const scope = tenant ? ` of ${tenant}` : "";

  const content = [h("h1", {}, "Usage"), filters];
  if (!names.length) {
    content.push(emptyState("No usage in this period",
      `No request${scope} was recorded in the ${period.label.toLowerCase()}. Pick a longer period, or send a request with one of the tenant's keys.`));
    clear(main, content);
    return;
  }
  const tokensChart = chartBox("usage-tokens", `Tokens per ${period.width === "1h" ? "hour" : "day"}${scope}, by ${VIEWS[view].toLowerCase()}`,
    `Stacked bar chart of input and output tokens per ${VIEWS[view].toLowerCase()}; the same numbers are in the table below`);
  const costChart = chartBox("usage-cost", `Cost per ${period.width === "1h" ? "hour" : "day"}${scope}, by ${VIEWS[view].toLowerCase()}`,
    `Stacked bar chart of cost per ${VIEWS[view].toLowerCase()}; the same numbers are in the table below`);
  const table = h("table", { class: "stack", id: "usage-table" },
    h("caption", {}, `Totals${scope}, ${period.label.toLowerCase()}`),
    h("thead", {}, h("tr", {}, [VIEWS[view], "Requests", "Input tokens", "Output tokens", "Cost"].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, names.map((n) => {
      const s = series.get(n);
      return h("tr", { dataset: { series: n } },
        h("th", { scope: "row", "data-label": VIEWS[view] }, n),
        h("td", { "data-label": "Requests" }, fmt.int(total(s, "requests"))),
        h("td", { "data-label": "Input tokens" }, fmt.int(total(s, "input"))),
        h("td", { "data-label": "Output tokens" }, fmt.int(total(s, "output"))),
        h("td", { "data-label": "Cost" }, priced && !total(s, "unpriced") ? fmt.money(total(s, "cost")) : "not priced"));
    })));
  const costPart = priced ? costChart.element
    : h("div", { class: "card" }, h("h2", {}, "Cost"), h("p", {}, "Costs appear here once prices are set for this base model (the billing price book); token counts are exact meanwhile."));
  content.push(h("div", { class: "charts" }, tokensChart.element, costPart), h("div", { class: "table-wrap card" }, table));
  clear(main, content);
  const color = (i) => COLORS[i % COLORS.length];
  const drew = drawChart(tokensChart.canvas, labels,
    names.map((n, i) => ({ label: n, data: series.get(n).input.map((x, j) => x + series.get(n).output[j]), backgroundColor: color(i) })),
    "tokens");
  if (priced) {
    drawChart(costChart.canvas, labels,
      names.map((n, i) => ({ label: n, data: series.get(n).cost.map((x, j) => (series.get(n).unpriced[j] ? null : x / 1e6)), backgroundColor: color(i) })), "cost (USD)");
  }
  if (!drew) content[1].after(h("p", { class: "notice info" }, "Charts are unavailable (the chart library was not built: run make setup); the table below has the numbers."));
}
