// Keys: issue (the secret is shown once, with a copy button), find by prefix, revoke.
import { api } from "../api.js";
import { badge, busy, clear, confirmDialog, emptyState, field, fmt, h, tenantPickerOrNotice, toast } from "../ui.js";

export const title = "Keys";

export async function render(main, ctx) {
  const picker = await tenantPickerOrNotice(main, "Keys", ctx.params.get("tenant"), (t) => ctx.setParams({ tenant: t, prefix: null }));
  if (!picker) return;
  const tenant = picker.value;
  const enc = encodeURIComponent(tenant);
  const keys = (await api("GET", `/tenants/${enc}/keys`)).data;

  const secretBox = h("div", { "aria-live": "polite" });
  const name = h("input", { name: "key_name", maxlength: 64, autocomplete: "off", placeholder: "e.g. production" });
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button primary" }, "Issue key");
  const form = h("form", { class: "row-form" }, field("Key name (optional)", name), h("div", { class: "field actions" }, submit));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    busy(submit, async () => {
      const k = await api("POST", `/tenants/${enc}/keys`, { name: name.value.trim() || null });
      await renderList();
      showSecret(secretBox, k);
      name.value = "";
    }, errors);
  });

  const filter = h("input", { type: "search", name: "prefix", value: ctx.params.get("prefix") || "", placeholder: "tsk-…", autocomplete: "off" });
  const listBox = h("div");
  let current = keys;
  async function renderList(fresh = true) {
    if (fresh) current = (await api("GET", `/tenants/${enc}/keys`)).data;
    const q = filter.value.trim().replace(/^tsk-/, "");
    const shown = current.filter((k) => !q || k.prefix.startsWith(q));
    if (!current.length) {
      clear(listBox, emptyState("No keys yet", `Issue ${tenant}'s first key above; the tenant calls the API with it.`));
      return;
    }
    if (!shown.length) {
      clear(listBox, h("p", { class: "muted" }, `No key of ${tenant} starts with “${q}”.`));
      return;
    }
    clear(listBox, h("div", { class: "table-wrap" }, h("table", { class: "stack" },
      h("thead", {}, h("tr", {}, ["Name", "Prefix", "Created", "Status", h("span", { class: "visually-hidden" }, "Actions")].map((c) => h("th", { scope: "col" }, c)))),
      h("tbody", {}, shown.map((k) => keyRow(k))))));
  }
  function keyRow(k) {
    let action = null;
    if (!k.revoked_at) {
      action = h("button", { type: "button", class: "button small danger" }, "Revoke", h("span", { class: "visually-hidden" }, ` key tsk-${k.prefix}`));
      action.addEventListener("click", async () => {
        if (!(await confirmDialog(`Revoke key tsk-${k.prefix}…?`, "Requests with this key are refused from the next one. This cannot be undone.", "Revoke key"))) return;
        await busy(action, async () => {
          await api("DELETE", `/tenants/${enc}/keys/${k.id}`);
          toast(`Key tsk-${k.prefix}… revoked.`);
          await renderList();
        });
      });
    }
    return h("tr", {},
      h("td", { "data-label": "Name" }, k.name || h("span", { class: "muted" }, "unnamed")),
      h("td", { "data-label": "Prefix" }, h("code", {}, `tsk-${k.prefix}…`)),
      h("td", { "data-label": "Created" }, fmt.date(k.created_at)),
      h("td", { "data-label": "Status" }, k.revoked_at ? h("span", {}, badge("revoked"), ` ${fmt.date(k.revoked_at)}`) : badge("active")),
      h("td", { "data-label": "" }, action));
  }
  filter.addEventListener("input", () => renderList(false));
  await renderList(false);

  clear(main,
    h("h1", {}, "Keys"),
    h("div", { class: "toolbar" }, picker.element),
    h("section", { class: "card", "aria-labelledby": "issue-title" }, h("h2", { id: "issue-title" }, `Issue a key for ${tenant}`), form, errors, secretBox),
    h("section", { class: "card", "aria-labelledby": "keys-title" }, h("h2", { id: "keys-title" }, `Keys of ${tenant}`),
      h("div", { class: "toolbar" }, field("Find by prefix", filter)), listBox));
}

function showSecret(box, k) {
  const input = h("input", { readonly: true, value: k.key, class: "secret", "aria-label": "New API key", spellcheck: "false" });
  const copy = h("button", { type: "button", class: "button" }, "Copy key");
  const copied = h("span", { class: "muted", role: "status" });
  copy.addEventListener("click", async () => {
    input.select();
    try {
      await navigator.clipboard.writeText(k.key);
      copied.textContent = "Copied to the clipboard.";
    } catch {
      copied.textContent = "Select the key and copy it with Ctrl+C (the browser refused clipboard access).";
    }
  });
  const done = h("button", { type: "button", class: "button subtle", onclick: () => box.replaceChildren() }, "I have saved it");
  clear(box, h("div", { class: "notice success secret-box" },
    h("p", {}, h("strong", {}, `Key tsk-${k.prefix}… issued for ${k.tenant}. `), "Copy it now: it is shown only this once and cannot be recovered."),
    h("div", { class: "secret-row" }, input, copy), copied, h("div", {}, done)));
  input.focus();
  input.select();
}
