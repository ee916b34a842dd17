// The console's shell: the API key form and the tabs. Each page is a module exporting
// mount(container, args) -> unmount function; adding a page is one module and one PAGES entry.

import { apiKey, setApiKey } from "./api.js";
import * as batches from "./batches.js";
import * as fleet from "./fleet.js";
import * as jobs from "./jobs.js";
import * as playground from "./playground.js";

const PAGES = [
  { id: "playground", title: "Playground", page: playground },
  { id: "jobs", title: "Jobs", page: jobs },
  { id: "batches", title: "Batches", page: batches },
  { id: "fleet", title: "Fleet", page: fleet },
];

let unmount = null;  // the shown page's cleanup (stops its timers and streams)

function route() {
  const [id, ...args] = (location.hash.replace(/^#\/?/, "") || PAGES[0].id).split("/");
  const entry = PAGES.find((p) => p.id === id) || PAGES[0];
  for (const link of document.querySelectorAll("#tabs a")) {
    link.classList.toggle("active", link.dataset.page === entry.id);
  }
  if (unmount) unmount();
  const container = document.getElementById("page");
  container.replaceChildren();
  unmount = entry.page.mount(container, args.map(decodeURIComponent)) || null;
}

function showKeyState() {
  document.getElementById("key-state").textContent = apiKey() ? "key set" : "no key";
}

function start() {
  const tabs = document.getElementById("tabs");
  for (const { id, title } of PAGES) {
    const link = document.createElement("a");
    link.href = `#/${id}`;
    link.textContent = title;
    link.dataset.page = id;
    link.id = `tab-${id}`;
    tabs.append(link);
  }
  const input = document.getElementById("api-key");
  input.value = apiKey();
  document.getElementById("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    setApiKey(input.value.trim());
    showKeyState();
    route();  // reload the page's data with the new key
  });
  showKeyState();
  window.addEventListener("hashchange", route);
  route();
}

start();
