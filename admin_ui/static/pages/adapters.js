// Adapters: upload a PEFT adapter (drag-and-drop or file picker) with upload progress and the
// validation status live; versions, the current version, delete.
import { api, upload } from "../api.js";
import { badge, busy, clear, confirmDialog, emptyState, errorBox, field, fmt, h, newId, tenantPickerOrNotice, toast } from "../ui.js";

export const title = "Adapters";

const POLL_MS = 1000;
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;

export async function render(main, ctx) {
  const picker = await tenantPickerOrNotice(main, "Adapters", ctx.params.get("tenant"), (t) => ctx.setParams({ tenant: t }));
  if (!picker) return;
  const tenant = picker.value;
  const enc = encodeURIComponent(tenant);
  const listBox = h("div");
  // The served base models, offered in the upload form's "Base model" field, and what the engine
  // says about each (architecture, layers, the modules an adapter may target).
  const baseModels = h("datalist", { id: newId("base-models") });
  const servedModel = h("p", { class: "hint served-model" });

  async function refresh() {
    const answer = await api("GET", `/tenants/${enc}/adapters`);
    if (ctx.signal.aborted) return;
    clear(baseModels, (answer.served_base_models || []).map((m) => h("option", { value: m })));
    clear(servedModel, (answer.served_base_model_details || []).map((m) => h("span", {},
      "Served base model: ", h("code", {}, m.name), ` (${m.architecture}, ${m.num_layers} layers). `,
      "An adapter's target_modules name its modules: ", h("code", {}, m.modules.join(", ")), ".")));
    const adapters = answer.data;
    if (!adapters.length) {
      clear(listBox, emptyState("No adapters yet",
        `Upload ${tenant}'s first LoRA adapter above: the adapter_config.json and adapter_model.safetensors that PEFT saves, or a .zip of them.`));
      return;
    }
    clear(listBox, adapters.map((a) => adapterCard(a)));
  }

  function adapterCard(a) {
    const del = h("button", { type: "button", class: "button small danger" }, "Delete adapter", h("span", { class: "visually-hidden" }, ` ${a.name}`));
    del.addEventListener("click", async () => {
      if (!(await confirmDialog(`Delete adapter ${a.name}?`,
        `Every version of ${a.name} is deleted; requests naming it get 404. Usage records are kept.`, "Delete adapter"))) return;
      await busy(del, async () => {
        await api("DELETE", `/tenants/${enc}/adapters/${encodeURIComponent(a.name)}`);
        toast(`Adapter ${a.name} deleted.`);
        await refresh();
      });
    });
    const rows = a.versions.map((v) => versionRow(a, v));
    return h("section", { class: "card adapter", "aria-label": `Adapter ${a.name}`, dataset: { adapter: a.name } },
      h("div", { class: "title-row" },
        h("h3", {}, a.name, " ", h("span", { class: "muted" }, a.current_version ? `current: version ${a.current_version}` : "no ready version")),
        del),
      h("div", { class: "table-wrap" }, h("table", { class: "stack" },
        h("thead", {}, h("tr", {}, ["Version", "Status", "Rank", "Modules", "Size", "Uploaded", h("span", { class: "visually-hidden" }, "Actions")].map((c) => h("th", { scope: "col" }, c)))),
        h("tbody", {}, rows))));
  }

  function versionRow(a, v) {
    const actions = h("div", { class: "inline-actions" });
    if (v.status === "ready" && !v.current) {
      const make = h("button", { type: "button", class: "button small" }, "Make current", h("span", { class: "visually-hidden" }, ` ${v.ref}`));
      make.addEventListener("click", () => busy(make, async () => {
        await api("PUT", `/tenants/${enc}/adapters/${encodeURIComponent(a.name)}/current`, { version: v.version });
        toast(`${a.name} now serves version ${v.version}.`);
        await refresh();
      }));
      actions.append(make);
    }
    const del = h("button", { type: "button", class: "button small subtle" }, "Delete", h("span", { class: "visually-hidden" }, ` version ${v.ref}`));
    del.addEventListener("click", async () => {
      if (!(await confirmDialog(`Delete ${v.ref}?`, v.current
        ? "This is the current version: the newest other ready version becomes current."
        : "Requests naming this version will get 404.", "Delete version"))) return;
      await busy(del, async () => {
        await api("DELETE", `/tenants/${enc}/adapters/${encodeURIComponent(a.name)}/versions/${v.version}`);
        toast(`${v.ref} deleted.`);
        await refresh();
      });
    });
    actions.append(del);
    const status = h("div", {}, badge(v.status), v.current ? h("span", { class: "badge current" }, "current") : null);
    if ((v.status === "rejected" || v.status === "quarantined") && v.rejection_reason) status.append(h("p", { class: "reason" }, v.rejection_reason));
    return h("tr", {},
      h("td", { "data-label": "Version" }, h("code", {}, v.ref)),
      h("td", { "data-label": "Status" }, status),
      h("td", { "data-label": "Rank" }, v.rank ?? "—"),
      h("td", { "data-label": "Modules" }, v.target_modules ? v.target_modules.join(", ") : "—"),
      h("td", { "data-label": "Size" }, fmt.bytes(v.size_bytes)),
      h("td", { "data-label": "Uploaded" }, fmt.date(v.created_at)),
      h("td", { "data-label": "" }, actions));
  }

  clear(main,
    h("h1", {}, "Adapters"),
    h("div", { class: "toolbar" }, picker.element),
    uploadCard(tenant, ctx, refresh, baseModels, servedModel),
    h("section", { class: "card-list", "aria-label": `Adapters of ${tenant}` }, h("h2", {}, `Adapters of ${tenant}`), listBox));
  await refresh();
}

function uploadCard(tenant, ctx, refresh, baseModels, servedModel) {
  const enc = encodeURIComponent(tenant);
  let files = [];
  const name = h("input", { name: "adapter_name", required: true, maxlength: 64, autocomplete: "off", placeholder: "e.g. support-bot" });
  // Optional: the server reads the base model from adapter_config.json, and refuses (422, naming
  // this field) one it cannot tell, such as the path of a local checkout it has no alias for.
  const baseModel = h("input", { name: "base_model", autocomplete: "off", spellcheck: "false",
    list: baseModels.id, placeholder: "from adapter_config.json" });
  // The file input stays in the tab order (Enter or Space opens the picker); its label is the
  // visible button.
  const input = h("input", { type: "file", id: "adapter-files", name: "files", multiple: true,
    class: "file-input visually-hidden", "aria-describedby": "adapter-files-hint" });
  const chosen = h("ul", { class: "file-list", "aria-label": "Chosen files" });
  const zone = h("div", { class: "dropzone" },
    h("p", {}, h("strong", {}, "Drag and drop the adapter's files here, or")),
    input, h("label", { for: "adapter-files", class: "button choose" }, "Choose files…"),
    h("p", { class: "hint", id: "adapter-files-hint" }, "adapter_config.json + adapter_model.safetensors, or one .zip / .tar.gz holding them."),
    chosen);
  const progress = h("progress", { max: 100, value: 0, "aria-label": "Upload progress" });
  const progressText = h("span", { class: "progress-text" });
  const progressRow = h("div", { class: "progress-row", hidden: true }, progress, progressText);
  const status = h("div", { class: "upload-status", role: "status", "aria-live": "polite" });
  const errors = h("div");
  const submit = h("button", { type: "submit", class: "button primary" }, "Upload");

  function setFiles(list) {
    files = Array.from(list);
    clear(chosen, files.map((f) => h("li", {}, `${f.name} (${fmt.bytes(f.size)})`)));
    if (!name.value && files.length) {
      const guess = files.length === 1 ? files[0].name.replace(/\.(zip|tar\.gz|tgz|tar)$/i, "") : "";
      if (NAME_RE.test(guess) && !/^adapter_/.test(guess)) name.value = guess;
    }
  }
  input.addEventListener("change", () => setFiles(input.files));
  for (const ev of ["dragenter", "dragover"]) {
    zone.addEventListener(ev, (e) => {
      e.preventDefault();
      zone.classList.add("dragging");
    });
  }
  for (const ev of ["dragleave", "drop"]) zone.addEventListener(ev, () => zone.classList.remove("dragging"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    if (e.dataTransfer && e.dataTransfer.files.length) setFiles(e.dataTransfer.files);
  });

  const form = h("form", { class: "upload-form" },
    field("Adapter name", name, "A new name creates an adapter; an existing one gets a new version."),
    zone,
    field("Base model (optional)", baseModel,
      "Leave empty unless the upload is refused for its base model: adapter_config.json may name a local path this server cannot tell. Then choose the served model the adapter was trained on."),
    servedModel, baseModels, h("div", { class: "actions" }, submit), progressRow, status, errors);

  function showStatus(v) {
    if (v.status === "validating") {
      clear(status, h("p", {}, badge("validating"), ` Checking ${v.ref}: config, base model, shapes, dtype and values…`));
    } else if (v.status === "ready") {
      clear(status, h("div", { class: "notice success" }, badge("ready"),
        ` ${v.ref} is ready (rank ${v.rank}, ${v.target_modules.join(", ")})${v.current ? " and is now the current version" : ""}. Call it with "model": "${v.ref.split("@")[0]}".`));
    } else {
      clear(status, h("div", { class: "notice error" }, badge(v.status), ` ${v.ref} was ${v.status}: `, h("span", { class: "reason" }, v.rejection_reason || "no reason given")));
    }
  }

  async function poll(adapterName, version) {
    while (!ctx.signal.aborted) {
      await new Promise((r) => setTimeout(r, POLL_MS));
      const a = await api("GET", `/tenants/${enc}/adapters/${encodeURIComponent(adapterName)}`);
      const v = a.versions.find((x) => x.version === version);
      if (!v) return;
      if (v.status !== "validating") {
        showStatus(v);
        await refresh();
        return;
      }
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    errors.replaceChildren();
    status.replaceChildren();
    const adapterName = name.value.trim();
    if (!NAME_RE.test(adapterName)) {
      errors.append(errorBox(new Error("Enter an adapter name: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit.")));
      name.focus();
      return;
    }
    if (!files.length) {
      errors.append(errorBox(new Error("Choose the adapter's files first (drop them on the box or use “choose files”).")));
      return;
    }
    const data = new FormData();
    for (const f of files) data.append("files", f, f.name);
    if (baseModel.value.trim()) data.append("base_model", baseModel.value.trim());
    busy(submit, async () => {
      progressRow.hidden = false;
      progress.value = 0;
      progressText.textContent = "Uploading 0%";
      const v = await upload(`/tenants/${enc}/adapters/${encodeURIComponent(adapterName)}/versions`, data, {
        onProgress(sent, total) {
          const pct = Math.floor((sent / total) * 100);
          progress.value = pct;
          progressText.textContent = `Uploading ${pct}% (${fmt.bytes(sent)} of ${fmt.bytes(total)})`;
        },
        onSent() {
          progress.value = 100;
          progressText.textContent = "Uploaded";
          clear(status, h("p", {}, badge("validating"), " Upload complete; validating the adapter…"));
        },
      }).catch((err) => {
        progressRow.hidden = true;
        status.replaceChildren();
        if (err.status === 422 || err.status === 413) err.message = `The upload was refused: ${err.message}`;
        throw err;
      });
      showStatus(v);
      await refresh();
      if (v.status === "validating") poll(adapterName, v.version).catch((err) => errors.append(errorBox(err)));
      files = [];
      input.value = "";
      chosen.replaceChildren();
    }, errors);
  });
  return h("section", { class: "card", "aria-labelledby": "upload-title" }, h("h2", { id: "upload-title" }, `Upload an adapter for ${tenant}`), form);
}
