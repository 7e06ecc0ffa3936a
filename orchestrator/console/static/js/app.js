// The console's shell: login, navigation and the hash router (#/jobs, #/jobs/ID, #/trainers, #/sweeps,
// #/sweeps/NAME, #/submit, #/submit?clone=ID). Each page is a module with `render(params, session)` that
// returns a function stopping whatever it follows.
import { api, token, whenUnauthorized } from "./api.js";
import * as jobPage from "./pages/job.js";
import * as jobsPage from "./pages/jobs.js";
import * as submitPage from "./pages/submit.js";
import * as sweepsPage from "./pages/sweeps.js";
import * as trainersPage from "./pages/trainers.js";
import { message, setView } from "./ui.js";

const login = document.getElementById("login");
const view = document.getElementById("view");
const nav = document.getElementById("nav");
const who = document.getElementById("who");
const logout = document.getElementById("logout");
let session = null;
let stop = () => {};

function showLogin(why) {
  stop();
  stop = () => {};
  session = null;
  token.clear();
  view.hidden = true;
  nav.hidden = true;
  logout.hidden = true;
  who.textContent = "";
  login.hidden = false;
  document.getElementById("login-error").textContent = why || "";
  document.getElementById("token").focus();
}

whenUnauthorized((detail) => showLogin(detail ? `Refused: ${detail}` : "Your token was refused; log in again."));

async function start() {
  try {
    session = await api("/whoami");
  } catch (error) {
    if (error.status !== 401) showLogin(`The API does not answer: ${error.message}`);
    return;
  }
  login.hidden = true;
  view.hidden = false;
  nav.hidden = false;
  logout.hidden = false;
  who.textContent = `${session.name}${session.admin ? " (admin)" : ""}`;
  route();
}

function route() {
  if (!session) return;
  stop();
  stop = () => {};
  const [path, query] = (location.hash.replace(/^#/, "") || "/jobs").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query || "");
  for (const link of nav.querySelectorAll("a")) {
    link.toggleAttribute("aria-current", link.getAttribute("href") === `#/${parts[0] || "jobs"}`);
  }
  const pages = {
    jobs: () => (parts[1] ? jobPage.render(parts[1], session) : jobsPage.render(params, session)),
    trainers: () => trainersPage.render(session),
    sweeps: () => sweepsPage.render(parts[1], session),
    submit: () => submitPage.render(params, session),
  };
  const page = pages[parts[0] || "jobs"];
  if (!page) {
    setView("Not found", message(`No page ${path}; the pages are Jobs, Trainers, Sweeps and Submit.`, "error"));
    return;
  }
  const stopper = page();
  stop = typeof stopper === "function" ? stopper : () => {};
  view.focus({ preventScroll: true });
}

document.getElementById("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("token");
  token.set(input.value.trim());
  input.value = "";
  start();
});
logout.addEventListener("click", () => showLogin("Logged out."));
window.addEventListener("hashchange", route);

if (token.get()) start();
else showLogin();
