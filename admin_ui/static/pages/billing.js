// Billing: a tenant's months (open or closed) with their amounts, one month's invoice and line
// items, closing a month, exports (generate, list, download), the price book, and a rollup on
// demand (GET/POST /admin/v1/billing/..., /admin/v1/tenants/{tenant}/billing/...).
//
// Money arrives as integer micro-units (*_micros) and exact line amounts in pico-units
// (amount_picos, 1e-12); it is formatted with BigInt arithmetic (ui.js fmt.micros, fmt.picos),
// never through floats, which lose digits on large sums.
import { api, ApiFailure } from "../api.js";
import {
  badge, busy, clear, confirmDialog, emptyState, errorBox, field, fmt, h, newId, parseMicros, roundPicos,
  tenantPicker, toast, unavailable,
} from "../ui.js";

export const title = "Billing";

const FORMATS = {
  csv: "CSV: line items",
  parquet: "Parquet: line items",
  jsonl: "JSON Lines: one CloudEvent per request",
};
const POLL_MS = 2000;
const POLL_LIMIT_MS = 120_000; // a queued export not written by then: say so and stop waiting
const PERIOD_RE = /^\d{4}-(0[1-9]|1[0-2])$/;

/** "2026-11" -> "November 2026" */
function monthName(period) {
  const [y, m] = period.split("-").map(Number);
  return new Date(Date.UTC(y, m - 1, 1)).toLocaleDateString("en-GB", { month: "long", year: "numeric", timeZone: "UTC" });
}

function todayUtc() {
  return new Date().toISOString().slice(0, 10);
}

/** "2026-11-22" -> "22 Nov 2026"; without the year when it is `sameYear`'s. */
function day(iso, sameYear) {
  const d = new Date(`${iso}T00:00:00Z`);
  const year = sameYear && iso.slice(0, 4) === sameYear ? undefined : "numeric";
  return d.toLocaleDateString("en-GB", { day: "numeric", month: "short", year, timeZone: "UTC" });
}

function plural(n, word, many = `${word}s`) {
  return `${fmt.int(n)} ${Number(n) === 1 ? word : many}`;
}

function cell(label, content, cls) {
  return h("td", { "data-label": label, class: cls }, content);
}

function headRow(columns) {
  return h("thead", {}, h("tr", {}, columns.map(([c, cls]) => h("th", { scope: "col", class: cls }, c))));
}

function select(name, options, value) {
  const s = h("select", { name });
  for (const [v, label] of Object.entries(options)) s.append(h("option", { value: v }, label));
  if (value !== undefined) s.value = value;
  return s;
}

async function loadState(tenant, wanted) {
  const enc = encodeURIComponent(tenant);
  const [prices, held, plans, periods, exports] = await Promise.all([
    api("GET", `/billing/prices${tenant ? `?tenant=${enc}` : ""}`),
    api("GET", "/billing/held"),
    api("GET", "/plans"), // the priority classes there are: the server's list, never a copy here
    tenant ? api("GET", `/tenants/${enc}/billing/periods`) : null,
    tenant ? api("GET", `/tenants/${enc}/billing/exports`) : null,
  ]);
  const months = periods ? periods.data : [];
  // Without a month in the address, open the newest one: usually the month in progress.
  const period = wanted || months[0]?.period || null;
  const detail = tenant && period ? await api("GET", `/tenants/${enc}/billing/periods/${period}`) : null;
  return {
    currency: prices.currency || periods?.currency || "USD",
    prices: prices.data,
    baseModels: prices.base_models || [],
    priorityClasses: plans.priority_classes,
    held: held.data,
    periods: months,
    exports: exports ? exports.data : [],
    period,
    detail,
  };
}

export async function render(main, ctx) {
  const picker = await tenantPicker(ctx.params.get("tenant"), (t) => ctx.setParams({ tenant: t, period: null }));
  const tenant = picker.value;
  const wanted = PERIOD_RE.test(ctx.params.get("period") || "") ? ctx.params.get("period") : null;
  let state;
  try {
    state = await loadState(tenant, wanted);
  } catch (err) {
    if (err instanceof ApiFailure && err.unavailable) {
      clear(main, h("h1", {}, "Billing"), unavailable("Billing"));
      return;
    }
    throw err;
  }
  if (ctx.signal.aborted) return;
  const page = new BillingPage(ctx, tenant, state);
  clear(main,
    h("h1", {}, "Billing"),
    h("div", { class: "toolbar" }, picker.element, page.rollupButton),
    page.rollupBox,
    page.heldBox,
    picker.empty
      ? emptyState("No tenants yet", "Billing periods belong to a tenant. Create a tenant first; prices can be set meanwhile.",
        h("a", { href: "/admin/tenants", "data-nav": true, class: "button primary" }, "Go to Tenants"))
      : [page.periodsCard, page.detailCard, page.exportsCard],
    page.pricesCard);
  page.fill();
}

/** The page's sections, each refilled from the latest state after an action. */
class BillingPage {
  constructor(ctx, tenant, state) {
    this.ctx = ctx;
    this.tenant = tenant;
    this.enc = encodeURIComponent(tenant);
    this.state = state;
    this.rollupButton = h("button", { type: "button", class: "button", onclick: () => this.rollup() }, "Roll up now");
    this.rollupBox = h("div", { class: "rollup-status", "aria-live": "polite" });
    this.heldBox = h("div");
    this.periodsCard = h("section", { class: "card", "aria-labelledby": "periods-title" });
    this.detailCard = h("section", { class: "card", "aria-labelledby": "period-title", id: "period" });
    this.exportsCard = h("section", { class: "card", "aria-labelledby": "exports-title" });
    this.pricesCard = h("section", { class: "card", "aria-labelledby": "prices-title" });
    this.priceForm = new PriceForm(this);
  }

  fill() {
    this.fillHeld();
    this.fillPeriods();
    this.fillDetail();
    this.fillExports();
    this.fillPrices();
  }

  async refresh() {
    const state = await loadState(this.tenant, this.state.period);
    if (this.ctx.signal.aborted) return;
    this.state = state;
    this.fill();
  }

  get currency() {
    return this.state.currency;
  }

  async rollup() {
    await busy(this.rollupButton, async () => {
      const r = await api("POST", "/billing/rollup");
      const heldTokens = r.held.reduce((a, x) => a + Number(x.tokens), 0);
      const text = r.events > 0
        ? `Rollup done: ${plural(r.events, "new usage event")} billed into line items.`
        : "Rollup done: no new usage events since the last rollup; pending line items were re-priced from the price book.";
      clear(this.rollupBox, h("div", { class: "notice success" }, text,
        heldTokens ? ` ${plural(heldTokens, "token")} of usage are held for want of a price (listed below).` : null));
      await this.refresh();
    }, this.rollupBox);
  }

  // ---- held usage: tokens without a price, never billed at zero
  fillHeld() {
    const held = this.state.held.filter((x) => Number(x.tokens) > 0);
    if (!held.length) {
      this.heldBox.replaceChildren();
      return;
    }
    const id = newId("held");
    clear(this.heldBox, h("section", { class: "notice warn", "aria-labelledby": id },
      h("h2", { id }, "Usage without a price is held"),
      h("p", {}, "Across all tenants, these tokens are not billed until a price exists for their base model, priority class and token kind. ",
        "Set the missing prices; the next rollup prices the held usage and it is invoiced with its month."),
      h("ul", { class: "held-list" }, held.map((x) => {
        const set = h("button", { type: "button", class: "button small" }, "Set this price",
          h("span", { class: "visually-hidden" }, ` (${x.base_model}, ${x.priority}, ${x.token_kind} tokens)`));
        set.addEventListener("click", () => this.priceForm.prefill(x));
        return h("li", {},
          h("span", {}, h("strong", {}, `${plural(x.tokens, "token")} `),
            `of ${x.base_model}, ${x.priority} priority, ${x.token_kind} tokens `,
            h("span", { class: "muted" }, `(${plural(x.line_items, "line item")}, ${plural(x.tenants, "tenant")})`)),
          set);
      }))));
  }

  // ---- the tenant's months
  fillPeriods() {
    const { periods, period } = this.state;
    const heading = h("h2", { id: "periods-title" }, `Billing periods of ${this.tenant}`);
    if (!periods.length) {
      clear(this.periodsCard, heading, emptyState("No usage billed yet",
        `${this.tenant} has no billed usage. Once it sends requests with one of its keys, its usage is billed at the next rollup (every few minutes), or press “Roll up now”.`,
        h("a", { href: `/admin/keys?tenant=${this.enc}`, "data-nav": true, class: "button" }, `Keys of ${this.tenant}`)));
      return;
    }
    const cur = this.currency;
    const rows = periods.map((p) => {
      const inv = p.invoice;
      const pend = p.pending;
      const n = inv || pend;
      const link = h("a", {
        href: `/admin/billing?tenant=${this.enc}&period=${p.period}`, "data-nav": true,
        "aria-current": p.period === period ? "true" : null,
      }, monthName(p.period));
      const amount = inv
        ? h("span", {}, fmt.micros(inv.total_micros, inv.currency), h("span", { class: "muted" }, " invoiced"))
        : h("span", {}, fmt.micros(pend.amount_micros, cur), h("span", { class: "muted" }, " so far"));
      const late = inv && pend && Number(pend.requests) > 0
        ? h("span", { class: "muted" }, ` + late usage pending (${plural(pend.requests, "request")})`) : null;
      const heldTokens = pend ? Number(pend.held_tokens) : 0;
      return h("tr", { class: p.period === period ? "selected" : null, dataset: { period: p.period } },
        h("th", { scope: "row", "data-label": "Month" }, link),
        cell("Status", [badge(p.status), late]),
        cell("Requests", fmt.int(n.requests), "num"),
        cell("Tokens", fmt.int(Number(n.input_tokens) + Number(n.output_tokens)), "num"),
        cell("Amount", amount, "num"),
        cell("Held tokens", heldTokens
          ? h("span", { class: "warn-text" }, `${fmt.int(heldTokens)} not billed`)
          : h("span", { class: "muted" }, "none"), "num"));
    });
    clear(this.periodsCard, heading,
      h("p", { class: "hint wide" }, "Calendar months (UTC), newest first. Open months show the amount so far, before any included-token credit; closed months show their invoice total."),
      h("div", { class: "table-wrap" }, h("table", { class: "stack", id: "periods" },
        headRow([["Month"], ["Status"], ["Requests", "num"], ["Tokens", "num"], ["Amount", "num"], ["Held tokens", "num"]]),
        h("tbody", {}, rows))));
  }

  // ---- one month: invoice or pending totals, actions, line items
  fillDetail() {
    const { detail, period } = this.state;
    if (!detail) {
      this.detailCard.hidden = true;
      return;
    }
    this.detailCard.hidden = false;
    const cur = detail.currency;
    const name = monthName(period);
    const errors = h("div", { class: "period-errors" });
    const exportStatus = h("div", { "aria-live": "polite" });
    const items = detail.line_items;

    const actions = [];
    if (detail.status === "open") {
      const close = h("button", { type: "button", class: "button danger" }, "Close month");
      close.addEventListener("click", () => this.closePeriod(close, errors));
      actions.push(close);
    }
    const formatSel = select("format", FORMATS, "csv");
    const generate = h("button", { type: "submit", class: "button primary" }, "Generate export");
    const exportForm = h("form", { class: "export-form", "aria-label": `Export ${name}` },
      field("Export format", formatSel), h("div", { class: "field actions" }, generate));
    exportForm.addEventListener("submit", (e) => {
      e.preventDefault();
      this.generateExport(generate, formatSel.value, errors, exportStatus);
    });

    clear(this.detailCard,
      h("div", { class: "title-row period-head" },
        h("h2", { id: "period-title" }, `${name} · ${this.tenant} `, badge(detail.status)),
        h("div", { class: "actions" }, actions)),
      detail.invoice ? invoiceSummary(detail.invoice) : pendingSummary(items, cur),
      h("div", { class: "period-actions" }, exportForm),
      errors, exportStatus,
      items.length ? lineItemsTable(items, cur, name, period.slice(0, 4))
        : emptyState("No usage in this month", detail.invoice
          ? `The invoice of ${name} has no line items: ${this.tenant} had no priced usage in it.`
          : `${this.tenant} has no billed usage in ${name}. Usage shows here after the next rollup.`));
  }

  async closePeriod(button, errors) {
    const { period } = this.state;
    const name = monthName(period);
    const ok = await confirmDialog(`Close ${name} for ${this.tenant}?`,
      "Closing rolls up the latest usage and writes the month's invoice; earlier months with pending usage are closed first. Invoiced line items never change afterwards, and usage that arrives later goes on the next invoice.",
      "Close month");
    if (!ok) return;
    errors.replaceChildren();
    button.disabled = true;
    try {
      const inv = await api("POST", `/tenants/${this.enc}/billing/periods/${period}/close`);
      toast(`${name} closed: invoice total ${fmt.micros(inv.total_micros, inv.currency)}.`);
      await this.refresh();
    } catch (err) {
      if (err.status === 409) {
        errors.append(h("div", { class: "notice error", role: "alert" },
          h("strong", {}, `${name} was not closed. `), err.message,
          " Months are closed automatically once they have ended; until then their usage keeps growing."));
      } else {
        errors.append(errorBox(err));
      }
    } finally {
      button.disabled = false;
    }
  }

  async generateExport(button, format, errors, status) {
    const { period } = this.state;
    const name = monthName(period);
    await busy(button, async () => {
      status.replaceChildren();
      const before = this.state.exports.find((e) => e.period === period && e.format === format);
      const r = await api("POST", `/tenants/${this.enc}/billing/periods/${period}/exports`, { format });
      let written = r;
      if (r && r.status === "queued") {
        clear(status, h("p", { class: "notice info" }, `The ${format} export of ${name} is queued; waiting for the billing worker to write it…`));
        written = await this.waitForExport(period, format, before);
        if (!written) {
          if (!this.ctx.signal.aborted) {
            clear(status, h("p", { class: "notice info" },
              `The ${format} export of ${name} is still queued. It appears in the list below once the billing worker has written it; check that a worker is running if it does not.`));
          }
          return;
        }
      }
      status.replaceChildren();
      toast(`Export ${written.filename} written: ${plural(written.rows, "row")}.`);
      await this.refresh();
    }, errors);
  }

  /** Poll the exports list until the (period, format) export is newer than `before`. */
  async waitForExport(period, format, before) {
    const deadline = Date.now() + POLL_LIMIT_MS;
    while (Date.now() < deadline && !this.ctx.signal.aborted) {
      await new Promise((resolve) => setTimeout(resolve, POLL_MS));
      const list = (await api("GET", `/tenants/${this.enc}/billing/exports?period=${period}`)).data;
      const e = list.find((x) => x.format === format);
      if (e && (!before || e.id !== before.id || e.created_at !== before.created_at)) return e;
    }
    return null;
  }

  // ---- exports of the tenant, every month
  fillExports() {
    const heading = h("h2", { id: "exports-title" }, `Exports of ${this.tenant}`);
    const list = this.state.exports;
    if (!list.length) {
      clear(this.exportsCard, heading, emptyState("No exports yet",
        "Generate one from a month above: CSV or Parquet for the line items, JSON Lines for a usage meter."));
      return;
    }
    clear(this.exportsCard, heading,
      h("p", { class: "hint wide" }, "Final exports were written after the month was closed; drafts while it was open (generate again after closing)."),
      h("div", { class: "table-wrap" }, h("table", { class: "stack", id: "exports" },
        headRow([["Month"], ["Format"], ["Rows", "num"], ["Size", "num"], ["SHA-256"], ["Kind"], ["Created"],
          [h("span", { class: "visually-hidden" }, "Download")]]),
        h("tbody", {}, list.map((e) => h("tr", { dataset: { format: e.format, period: e.period } },
          h("th", { scope: "row", "data-label": "Month" }, monthName(e.period)),
          cell("Format", e.format),
          cell("Rows", fmt.int(e.rows), "num"),
          cell("Size", fmt.bytes(Number(e.size_bytes)), "num"),
          cell("SHA-256", h("code", { title: e.sha256 }, `${e.sha256.slice(0, 12)}…`)),
          cell("Kind", e.final ? badge("final") : badge("draft")),
          cell("Created", fmt.date(e.created_at)),
          cell("", downloadLink(e))))))));
  }

  // ---- the price book
  fillPrices() {
    const { prices } = this.state;
    const heading = h("h2", { id: "prices-title" }, "Price book");
    const scope = this.tenant ? ` and contract prices of ${this.tenant}` : "";
    const table = prices.length
      ? h("div", { class: "table-wrap" }, h("table", { class: "stack", id: "prices" },
        h("caption", {}, `Book prices${scope}, per million tokens`),
        headRow([["Applies to"], ["Base model"], ["Priority"], ["Tokens"], ["Price per 1M tokens", "num"], ["Effective from"], ["In effect"]]),
        h("tbody", {}, withStatus(prices).map(({ p, status }) => h("tr", {},
          h("th", { scope: "row", "data-label": "Applies to" }, p.tenant ? `${p.tenant} (contract)` : "every tenant (book)"),
          cell("Base model", h("code", {}, p.base_model)),
          cell("Priority", p.priority),
          cell("Tokens", p.token_kind),
          cell("Price per 1M tokens", fmt.micros(p.micros_per_mtok, this.currency, 2), "num"),
          cell("Effective from", day(p.effective_from)),
          cell("In effect", status))))))
      : emptyState("No prices yet",
        "Usage is held, not billed, until a price exists for its base model, priority class and token kind. Set the first prices with the form below: an input and an output price for each priority class the tenants use.");
    this.priceForm.update();
    clear(this.pricesCard, heading, table, this.priceForm.element);
  }

  /** Base model names: the ones the engines serve first, then any this page has seen (prices,
   * held usage, the month's line items). */
  knownModels() {
    const names = new Set(this.state.baseModels || []);
    for (const x of this.state.held) names.add(x.base_model);
    for (const x of this.state.detail?.line_items || []) names.add(x.base_model);
    for (const x of this.state.prices) names.add(x.base_model);
    return [...names];
  }
}

/** Each price with whether it is in effect today: the latest entry of its key from on or before today. */
function withStatus(prices) {
  const today = todayUtc();
  const current = new Map();
  for (const p of prices) {
    const key = [p.tenant, p.base_model, p.priority, p.token_kind].join("\u0000");
    if (p.effective_from <= today && (!current.has(key) || current.get(key).effective_from < p.effective_from)) current.set(key, p);
  }
  const held = new Set(current.values());
  return prices.map((p) => ({
    p,
    status: held.has(p) ? h("span", { class: "badge current" }, "in effect")
      : p.effective_from > today ? h("span", { class: "muted" }, "from ", day(p.effective_from)) : h("span", { class: "muted" }, "superseded"),
  }));
}

function downloadLink(e) {
  const safe = typeof e.download_url === "string" && e.download_url.startsWith("/admin/v1/");
  // A plain link: the session cookie goes with a GET (no CSRF header needed), and the server's
  // Content-Disposition names the file.
  return h("a", { href: safe ? e.download_url : `/admin/v1/billing/exports/${e.id}/download`, download: e.filename, class: "button small" },
    "Download", h("span", { class: "visually-hidden" }, ` ${e.filename}`));
}

function summary(entries) {
  return h("dl", { class: "summary" }, entries.filter(Boolean).map(([term, value, cls]) =>
    h("div", { class: cls }, h("dt", {}, term), h("dd", {}, value))));
}

function invoiceSummary(inv) {
  const cur = inv.currency;
  const credit = Number(inv.allowance_tokens) > 0
    ? [`Included tokens credit`, h("span", {}, `− ${fmt.micros(inv.allowance_credit_micros, cur)}`,
      h("span", { class: "muted" }, ` (${fmt.int(inv.allowance_used_tokens)} of ${fmt.int(inv.allowance_tokens)} included tokens used)`))]
    : [`Included tokens credit`, h("span", { class: "muted" }, "none (the plan includes no tokens)")];
  const held = (inv.held || []).filter((x) => Number(x.tokens) > 0);
  return [
    summary([
      ["Subtotal", fmt.micros(inv.subtotal_micros, cur)],
      credit,
      ["Total", h("strong", {}, fmt.micros(inv.total_micros, cur)), "total"],
      ["Currency", cur],
      ["Closed at", fmt.date(inv.closed_at)],
      ["Line items", fmt.int(inv.line_items)],
      ["Requests", fmt.int(inv.requests)],
      ["Input / output tokens", `${fmt.int(inv.input_tokens)} / ${fmt.int(inv.output_tokens)}`],
      ["Cached input tokens", `${fmt.int(inv.cached_input_tokens || 0)} of the input tokens`],
    ]),
    held.length ? h("p", { class: "notice warn" }, h("strong", {}, "Held out of this invoice for want of a price: "),
      held.map((x) => `${plural(x.tokens, "token")} of ${x.base_model}, ${x.priority}, ${x.token_kind}`).join("; "),
      ". They are invoiced by the first close after a price exists.") : null,
  ];
}

function pendingSummary(items, cur) {
  let picos = 0n;
  let heldTokens = 0;
  let requests = 0;
  let input = 0;
  let cached = 0;
  let output = 0;
  for (const li of items) {
    requests += Number(li.requests);
    input += Number(li.input_tokens);
    cached += Number(li.cached_input_tokens || 0);
    output += Number(li.output_tokens);
    if (li.amount_picos === null || li.amount_picos === undefined) heldTokens += Number(li.input_tokens) + Number(li.output_tokens);
    else picos += BigInt(li.amount_picos);
  }
  return [
    h("p", { class: "hint wide" }, "This month is open: its usage is still being billed. The invoice, with any included-token credit, is written when the month is closed."),
    summary([
      ["Amount so far", h("strong", {}, fmt.micros(roundPicos(picos), cur)), "total"],
      ["Currency", cur],
      ["Requests", fmt.int(requests)],
      ["Input / output tokens", `${fmt.int(input)} / ${fmt.int(output)}`],
      ["Cached input tokens", `${fmt.int(cached)} of the input tokens`],
      heldTokens ? ["Held tokens", h("span", { class: "warn-text" }, `${fmt.int(heldTokens)}, not billed`)] : null,
    ]),
  ];
}

function lineItemsTable(items, cur, name, year) {
  const price = (micros) => (micros === null || micros === undefined
    ? h("span", { class: "warn-text" }, "no price") : fmt.micros(micros, cur, 2));
  return h("div", { class: "table-wrap" }, h("table", { class: "stack", id: "line-items" },
    h("caption", {}, `Line items of ${name}: usage per day, base model, adapter and priority class; prices per million tokens`),
    headRow([["Day"], ["Base model"], ["Adapter"], ["Priority"], ["Requests", "num"], ["Input tokens", "num"], ["Cached input", "num"],
      ["Output tokens", "num"], ["Input price", "num"], ["Cached input price", "num"], ["Output price", "num"], ["Amount", "num"], ["Status"]]),
    h("tbody", {}, items.map((li) => h("tr", { dataset: { adapter: li.adapter || "", priority: li.priority } },
      h("th", { scope: "row", "data-label": "Day" }, day(li.usage_day, year)),
      cell("Base model", h("code", {}, li.base_model)),
      cell("Adapter", li.adapter || h("span", { class: "muted" }, "base model")),
      cell("Priority", li.priority),
      cell("Requests", fmt.int(li.requests), "num"),
      cell("Input tokens", fmt.int(li.input_tokens), "num"),
      cell("Cached input", fmt.int(li.cached_input_tokens || 0), "num"),
      cell("Output tokens", fmt.int(li.output_tokens), "num"),
      cell("Input price", price(li.input_price_micros_per_mtok), "num"),
      cell("Cached input price", Number(li.cached_input_tokens || 0) ? price(li.cached_input_price_micros_per_mtok) : h("span", { class: "muted" }, "–"), "num"),
      cell("Output price", price(li.output_price_micros_per_mtok), "num"),
      cell("Amount", li.amount_picos === null || li.amount_picos === undefined
        ? h("span", { class: "warn-text" }, "not billed") : fmt.picos(li.amount_picos, cur), "num"),
      cell("Status", badge(li.status)))))));
}

function wide(fieldElement) {
  fieldElement.classList.add("wide");
  return fieldElement;
}

/** Set one price: PUT /billing/prices. The price is typed in currency units and sent in micro-units. */
class PriceForm {
  constructor(page) {
    this.page = page;
    const listId = newId("models");
    this.models = h("datalist", { id: listId });
    this.baseModel = h("input", { name: "base_model", required: true, autocomplete: "off", list: listId, spellcheck: "false" });
    this.priority = select("priority", Object.fromEntries(page.state.priorityClasses.map((p) => [p, p])), "standard");
    this.kind = select("token_kind", { input: "input tokens", cached_input: "cached input tokens (prefix cache; else the input price)", output: "output tokens" }, "input");
    this.price = h("input", { name: "price", required: true, inputmode: "decimal", autocomplete: "off", placeholder: "e.g. 0.15" });
    this.from = h("input", { name: "effective_from", type: "date", required: true, value: todayUtc() });
    this.appliesTo = h("select", { name: "tenant" });
    this.errors = h("div");
    this.submit = h("button", { type: "submit", class: "button primary" }, "Set price");
    this.priceField = wide(field(`Price per million tokens (${page.currency})`, this.price,
      "In currency units, up to 6 decimals: 0.15 is 150,000 micro-units."));
    this.element = h("form", { class: "grid-form price-form", "aria-labelledby": "price-form-title", novalidate: true },
      h("h3", { id: "price-form-title" }, "Set a price"),
      h("p", { class: "hint wide" }, "A price holds from its day (UTC) until a later entry of the same base model, priority class and token kind. Pending usage is re-priced at the next rollup; invoiced months keep their prices."),
      wide(field("Base model", this.baseModel, "The model name the engines serve, as in usage and line items.")), this.models,
      field("Priority class", this.priority),
      field("Token kind", this.kind),
      this.priceField,
      field("Effective from (UTC day)", this.from),
      wide(field("Applies to", this.appliesTo)),
      h("div", { class: "actions" }, this.submit),
      this.errors);
    this.element.addEventListener("submit", (e) => {
      e.preventDefault();
      this.save();
    });
  }

  /** Refresh the suggestions and the "applies to" choices; keeps what the admin typed. */
  update() {
    const models = this.page.knownModels();
    clear(this.models, models.map((m) => h("option", { value: m })));
    if (!this.baseModel.value && models.length) this.baseModel.value = models[0];
    const keep = this.appliesTo.value;
    clear(this.appliesTo, h("option", { value: "" }, "every tenant (the price book)"),
      this.page.tenant ? h("option", { value: this.page.tenant }, `${this.page.tenant} only (contract price)`) : null);
    this.appliesTo.value = keep === this.page.tenant ? keep : "";
  }

  prefill(x) {
    this.baseModel.value = x.base_model;
    this.priority.value = x.priority;
    this.kind.value = x.token_kind;
    this.appliesTo.value = "";
    this.price.focus();
    this.price.scrollIntoView({ block: "center" });
  }

  invalid(input, message) {
    input.setAttribute("aria-invalid", "true");
    this.errors.append(h("div", { class: "notice error", role: "alert" }, message));
    input.focus();
  }

  async save() {
    this.errors.replaceChildren();
    for (const el of [this.baseModel, this.price, this.from]) el.removeAttribute("aria-invalid");
    const model = this.baseModel.value.trim();
    if (!model) return this.invalid(this.baseModel, "Enter the base model the price is for.");
    const micros = parseMicros(this.price.value);
    if (micros === null) {
      return this.invalid(this.price, `Enter the price per million tokens as a number of ${this.page.currency} with at most 6 decimals, e.g. 0.15.`);
    }
    if (micros > BigInt(Number.MAX_SAFE_INTEGER)) return this.invalid(this.price, "That price is too large.");
    if (!/^\d{4}-\d{2}-\d{2}$/.test(this.from.value)) return this.invalid(this.from, "Enter the day the price takes effect.");
    const body = {
      base_model: model, priority: this.priority.value, token_kind: this.kind.value,
      micros_per_mtok: Number(micros), effective_from: this.from.value, tenant: this.appliesTo.value || null,
    };
    await busy(this.submit, async () => {
      const p = await api("PUT", "/billing/prices", body);
      const who = p.tenant ? `${p.tenant}'s contract` : "the book";
      toast(`Price set in ${who}: ${p.base_model}, ${p.priority}, ${p.token_kind} tokens at ${fmt.micros(p.micros_per_mtok, this.page.currency, 2)} per million from ${day(p.effective_from)}.`);
      this.price.value = "";
      await this.page.refresh();
    }, this.errors);
    return undefined;
  }
}
