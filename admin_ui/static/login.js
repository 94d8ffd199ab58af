// The sign-in page: POST /admin/session, then on to the page the admin asked for.
const form = document.getElementById("sign-in");
const error = document.getElementById("sign-in-error");
const password = document.getElementById("password");
password.focus(); // as autofocus does, also when the page came from a redirect

function nextPage() {
  const next = new URLSearchParams(location.search).get("next") || "";
  // Only a path inside the admin UI: never an address on another site.
  return /^\/admin(\/[A-Za-z0-9._~%\/-]*)?(\?[A-Za-z0-9._~%&=+-]*)?$/.test(next) ? next : "/admin/tenants";
}

function showError(message) {
  error.textContent = message;
  error.hidden = false;
  password.setAttribute("aria-invalid", "true");
  password.focus();
  password.select();
}

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  if (!password.value) {
    showError("Enter the admin password.");
    return;
  }
  const button = form.querySelector("button");
  button.disabled = true;
  button.textContent = "Signing in…";
  error.hidden = true;
  try {
    const r = await fetch("/admin/session", {
      method: "POST",
      credentials: "same-origin",
      headers: { "content-type": "application/json", accept: "application/json" },
      body: JSON.stringify({ password: password.value }),
    });
    if (r.ok) {
      location.assign(nextPage());
      return;
    }
    const body = await r.json().catch(() => null);
    if (r.status === 401 && body?.error?.code === "wrong_password") {
      showError("That password is not right. Check it and try again.");
    } else {
      showError(body?.error?.message || `Sign-in failed (the server answered ${r.status}).`);
    }
  } catch {
    showError("Could not reach the server. Check that Tessera is running and try again.");
  } finally {
    button.disabled = false;
    button.textContent = "Sign in";
  }
});
