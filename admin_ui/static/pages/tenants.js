// Tenants: list and create; one tenant's plan, quotas, priority classes, SLO objectives and
// suspension (/admin/tenants/<name>); plans (create or change).
import { api, ApiFailure } from "../api.js";
import {
  badge, busy, clear, confirmDialog, emptyState, errorBox, field, fmt, forgetTenants, h, listTenants, rememberTenant, toast,
  unavailable,
} from "../ui.js";
import { sloEditor } from "./slo.js";

export const title = "Tenants";

const LIMITS = [
  ["requests_per_minute", "Requests per minute"],
  ["tokens_per_minute", "Tokens per minute"],
  ["max_concurrent_requests", "Concurrent requests"],
  ["monthly_token_budget", "Monthly token budget"],
];

export async function render(main, ctx) {
  if (ctx.arg) return renderTenant(main, ctx, ctx.arg);
  const [tenants, plans] = await Promise.all([listTenants(true), api("GET", "/plans")]);
  clear(main,
    h("h1", {}, "Tenants"),
    createTenantForm(plans, ctx),
    tenantsTable(tenants),
    plansSection(plans, ctx));
}

function planSelect(plans, value) {
  const select = h("select", { name: "plan", required: true });
  for (const p of plans.data) select.append(h("option", { value: p.name }, p.name));
  select.value = value || (plans.data.some((p) => p.name === plans.default_plan) ? plans.default_plan : plans.data[0]?.name || "");
  return select;
}

function createTenantForm(plans, ctx) {
  const section = h("section", { class: "card", "aria-labelledby": "create-tenant-title" },
    h("h2", { id: "create-tenant-title" }, "Create a tenant"));
  if (!plans.data.length) {
    section.append(emptyState("No plans yet",
      "A tenant needs a plan (its quotas and priority classes). Create a plan below first."));
    return section;
  }
  const name = h("input", { name: "name", required: true, maxlength: 64, pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]{0,63}", autocomplete: "off" });
  const plan = planSelect(plans);
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button primary" }, "Create tenant");
  const form = h("form", { class: "row-form" },
    field("Name", name, "Letters, digits, '.', '_' or '-'; used in URLs and the API."),
    field("Plan", plan),
    h("div", { class: "field actions" }, submit));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    if (!name.value.trim()) {
      clear(errors, errorBox(new Error("Enter a name for the tenant.")));
      name.focus();
      return;
    }
    busy(submit, async () => {
      const t = await api("POST", "/tenants", { name: name.value.trim(), plan: plan.value });
      forgetTenants();
      toast(`Tenant ${t.name} created. Issue it a key next.`);
      ctx.navigate(`/admin/tenants/${encodeURIComponent(t.name)}`);
    }, errors);
  });
  section.append(form, errors);
  return section;
}

function limitSummary(policy) {
  if (!policy) return "no plan";
  return `${fmt.limit(policy.requests_per_minute)} req/min · ${fmt.limit(policy.tokens_per_minute)} tok/min`;
}

function tenantsTable(tenants) {
  const section = h("section", { class: "card", "aria-labelledby": "tenants-title" }, h("h2", { id: "tenants-title" }, "All tenants"));
  if (!tenants.length) {
    section.append(emptyState("No tenants yet", "Create the first tenant above, then issue it an API key on the Keys page."));
    return section;
  }
  const rows = tenants.map((t) => {
    const link = `/admin/tenants/${encodeURIComponent(t.name)}`;
    return h("tr", {},
      h("td", { "data-label": "Name" }, h("a", { href: link, "data-nav": true }, t.name)),
      h("td", { "data-label": "Status" }, badge(t.status)),
      h("td", { "data-label": "Plan" }, t.policy ? t.policy.plan : "—"),
      h("td", { "data-label": "Limits" }, limitSummary(t.policy)),
      h("td", { "data-label": "Priority" }, t.policy ? `${t.policy.default_priority} (allowed: ${t.policy.allowed_priorities.join(", ")})` : "—"),
      h("td", { "data-label": "Keys" }, h("a", { href: `/admin/keys?tenant=${encodeURIComponent(t.name)}`, "data-nav": true }, `${t.active_keys} active`)),
      h("td", { "data-label": "Adapters" }, h("a", { href: `/admin/adapters?tenant=${encodeURIComponent(t.name)}`, "data-nav": true }, String(t.adapters))),
      h("td", { "data-label": "" }, h("a", { href: link, "data-nav": true, class: "button small" }, "Edit", h("span", { class: "visually-hidden" }, ` ${t.name}`))));
  });
  section.append(h("div", { class: "table-wrap" }, h("table", { class: "stack" },
    h("thead", {}, h("tr", {}, ["Name", "Status", "Plan", "Limits", "Priority", "Keys", "Adapters", h("span", { class: "visually-hidden" }, "Actions")].map((c) => h("th", { scope: "col" }, c)))),
    h("tbody", {}, rows))));
  return section;
}

function numberInput(name, value, placeholder) {
  return h("input", { name, type: "number", min: 0, step: 1, inputmode: "numeric", value: value ?? "", placeholder });
}

function readNumber(input) {
  const v = input.value.trim();
  if (v === "") return null;
  const n = Number(v);
  if (!Number.isInteger(n) || n < 0) throw new Error(`${input.closest(".field").querySelector("label").textContent}: enter a whole number of 0 or more, or leave it empty.`);
  return n;
}

function priorityInputs(classes, allowed, def, { legend, planDefault }) {
  const boxes = classes.map((c) => h("label", { class: "check" },
    h("input", { type: "checkbox", name: "allowed", value: c, checked: allowed.includes(c) }), ` ${c}`));
  const select = h("select", { name: "default_priority" });
  if (planDefault) select.append(h("option", { value: "" }, `Plan's default (${planDefault})`));
  for (const c of classes) select.append(h("option", { value: c }, c));
  select.value = def || "";
  const fieldset = h("fieldset", { class: "checks" }, h("legend", {}, legend), boxes);
  return {
    elements: [fieldset, field("Default priority class", select, "Used when a request does not ask for a class.")],
    allowed: () => boxes.map((b) => b.querySelector("input")).filter((i) => i.checked).map((i) => i.value),
    def: () => select.value,
  };
}

function plansSection(plans, ctx) {
  const section = h("section", { class: "card", "aria-labelledby": "plans-title" }, h("h2", { id: "plans-title" }, "Plans"));
  if (plans.data.length) {
    section.append(h("div", { class: "table-wrap" }, h("table", { class: "stack" },
      h("thead", {}, h("tr", {}, ["Plan", ...LIMITS.map((l) => l[1]), "Priority classes"].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, plans.data.map((p) => h("tr", {},
        h("td", { "data-label": "Plan" }, p.name),
        LIMITS.map(([k, label]) => h("td", { "data-label": label }, fmt.limit(p[k]))),
        h("td", { "data-label": "Priority classes" }, `${p.allowed_priorities.join(", ")} (default ${p.default_priority})`)))))));
  } else {
    section.append(h("p", { class: "muted" }, "No plans yet. Create one with the form below."));
  }
  const name = h("input", { name: "plan_name", required: true, maxlength: 64, autocomplete: "off" });
  const inputs = LIMITS.map(([k]) => numberInput(k, "", "unlimited"));
  const prio = priorityInputs(plans.priority_classes, ["standard", "batch"], "standard", { legend: "Allowed priority classes" });
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button" }, "Save plan");
  const form = h("form", { class: "grid-form" },
    h("h3", {}, "Create or change a plan"),
    field("Plan name", name, "An existing name changes that plan for every tenant on it."),
    LIMITS.map(([, label], i) => field(label, inputs[i])),
    prio.elements,
    h("div", { class: "actions" }, submit), errors);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    busy(submit, async () => {
      const planName = name.value.trim();
      if (!planName) throw new Error("Enter a name for the plan.");
      const body = { allowed_priorities: prio.allowed(), default_priority: prio.def() };
      LIMITS.forEach(([k], i) => { body[k] = readNumber(inputs[i]); });
      await api("PUT", `/plans/${encodeURIComponent(planName)}`, body);
      await render(document.getElementById("main"), ctx);
      toast(`Plan ${planName} saved.`);
    }, errors);
  });
  section.append(form);
  return section;
}

async function renderTenant(main, ctx, name) {
  const enc = encodeURIComponent(name);
  let tenant;
  try {
    tenant = await api("GET", `/tenants/${enc}`);
  } catch (err) {
    if (err instanceof ApiFailure && err.status === 404) {
      clear(main, h("h1", {}, name), emptyState("No such tenant", `There is no tenant called “${name}”. It may have been renamed or never created.`,
        h("a", { href: "/admin/tenants", "data-nav": true, class: "button" }, "Back to tenants")));
      return;
    }
    throw err;
  }
  rememberTenant(tenant.name);
  const plans = await api("GET", "/plans");
  const statusBtn = tenant.status === "active"
    ? h("button", { type: "button", class: "button danger" }, "Suspend tenant")
    : h("button", { type: "button", class: "button primary" }, "Reactivate tenant");
  statusBtn.addEventListener("click", async () => {
    const suspending = tenant.status === "active";
    if (suspending && !(await confirmDialog(`Suspend ${tenant.name}?`,
      "Its API keys will be refused (403) from the next request until you reactivate it. Adapters, keys and usage are kept.",
      "Suspend"))) return;
    await busy(statusBtn, async () => {
      await api("PATCH", `/tenants/${enc}`, { status: suspending ? "suspended" : "active" });
      forgetTenants();
      await renderTenant(main, ctx, name);
      toast(suspending ? `${tenant.name} is suspended.` : `${tenant.name} is active again.`);
    });
  });

  const sloBox = h("section", { class: "card", "aria-labelledby": "slo-title" }, h("h2", { id: "slo-title" }, "SLO objectives"));
  clear(main,
    h("p", { class: "crumbs" }, h("a", { href: "/admin/tenants", "data-nav": true }, "Tenants"), " / ", tenant.name),
    h("div", { class: "title-row" }, h("h1", {}, tenant.name, " ", badge(tenant.status)), statusBtn),
    h("p", { class: "muted" }, `Created ${fmt.date(tenant.created_at)} · `,
      h("a", { href: `/admin/keys?tenant=${enc}`, "data-nav": true }, `${tenant.active_keys} active keys`), " · ",
      h("a", { href: `/admin/adapters?tenant=${enc}`, "data-nav": true }, `${tenant.adapters} adapters`), " · ",
      h("a", { href: `/admin/usage?tenant=${enc}`, "data-nav": true }, "usage")),
    quotaForm(tenant, plans, () => renderTenant(main, ctx, name)),
    sloBox);
  try {
    sloBox.append(await sloEditor(tenant.name));
  } catch (err) {
    sloBox.append(err instanceof ApiFailure && err.unavailable ? unavailable("Per-tenant SLO objectives") : errorBox(err));
  }
}

function quotaForm(tenant, plans, reload) {
  const enc = encodeURIComponent(tenant.name);
  const planOf = (n) => plans.data.find((p) => p.name === n);
  const plan = planSelect(plans, tenant.policy.plan);
  const inputs = LIMITS.map(([k]) => numberInput(k, tenant.overrides[k], ""));
  const showPlanValues = () => {
    const p = planOf(plan.value);
    LIMITS.forEach(([k], i) => {
      inputs[i].placeholder = p ? `plan: ${fmt.limit(p[k])}` : "";
    });
  };
  plan.addEventListener("change", showPlanValues);
  showPlanValues();
  const planP = planOf(tenant.policy.plan);
  const prio = priorityInputs(plans.priority_classes, tenant.policy.allowed_priorities, tenant.overrides.default_priority || "",
    { legend: "Allowed priority classes", planDefault: planP ? planP.default_priority : "plan" });
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button primary" }, "Save quotas");
  const form = h("form", { class: "grid-form", "aria-labelledby": "quota-title" },
    h("h2", { id: "quota-title" }, "Plan and quotas"),
    field("Plan", plan, "The plan gives the defaults; the fields below override them for this tenant only."),
    LIMITS.map(([, label], i) => field(label, inputs[i])),
    prio.elements,
    h("p", { class: "hint" }, "Leave a limit empty to use the plan's value."),
    h("div", { class: "actions" }, submit), errors);
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    busy(submit, async () => {
      const body = { plan: plan.value };
      LIMITS.forEach(([k], i) => { body[k] = readNumber(inputs[i]); });
      const allowed = prio.allowed();
      const p = planOf(plan.value);
      const same = p && allowed.length === p.allowed_priorities.length && allowed.every((c) => p.allowed_priorities.includes(c));
      if (!allowed.length) throw new Error("Allow at least one priority class.");
      body.allowed_priorities = same ? null : allowed;
      body.default_priority = prio.def() || null;
      await api("PATCH", `/tenants/${enc}/quotas`, body);
      await reload();
      toast(`Quotas of ${tenant.name} saved; they apply from the next request.`);
    }, errors);
  });
  return h("section", { class: "card" }, form);
}
