// Building DOM nodes without innerHTML (text is always text: a model's output can never become markup),
// and the number formats every page shares.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else if (name === "style") Object.assign(node.style, value);  // CSSOM: allowed by the console's CSP
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export function seconds(value) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (value < 1) return `${Math.round(value * 1000)} ms`;
  if (value < 120) return `${value.toFixed(2)} s`;
  return `${(value / 60).toFixed(1)} min`;
}

export function span(start, end) {
  return start && end ? seconds(end - start) : "–";
}

export function clock(unixSeconds) {
  return unixSeconds ? new Date(unixSeconds * 1000).toLocaleTimeString() : "–";
}

export function rate(value) {
  return value === null || value === undefined ? "–" : value.toFixed(1);
}

export function badge(status) {
  return el("span", { class: `badge ${status}`, "data-status": status, text: status });
}

export function stat(label, id, value = "–") {
  return el("div", { class: "stat" }, el("b", { id, text: value }), el("span", { text: label }));
}

export function isTerminal(status) {
  return status === "succeeded" || status === "failed" || status === "cancelled";
}
