// Billing: periods, invoices, exports (generate, download).
import { api, ApiFailure } from "../api.js";
import { clear, h, unavailable } from "../ui.js";

export const title = "Billing";

export async function render(main) {
  try {
    await api("GET", "/billing/periods");
  } catch (err) {
    if (err instanceof ApiFailure && err.unavailable) {
      clear(main, h("h1", {}, "Billing"), unavailable("Billing"));
      return;
    }
    throw err;
  }
  clear(main, h("h1", {}, "Billing"));
}
