// The page without a framework: posts to /v1/validate and renders the same markup as the server-side
// fallback (dduf_plus/serve/page.py). Archive content is only ever set as text (textContent), never as HTML.
"use strict";
(function () {
  const form = document.getElementById("check");
  const result = document.getElementById("result");
  const drop = document.getElementById("drop");
  const fileInput = document.getElementById("file");
  let fixes = null;

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return node;
  }

  function table(id, caption, heads, rows) {
    const head = el("tr", {}, ...heads.map((h) => el("th", { scope: "col" }, h)));
    return el("table", { id }, el("caption", {}, caption), el("thead", {}, head), el("tbody", {}, ...rows));
  }

  function reference(c) {
    const ref = c.external;
    if (!ref) return "in archive";
    const where = ref.pretrained_model_name_or_path || "(passed by the caller)";
    return where + (ref.subfolder ? "/" + ref.subfolder : "");
  }

  function render(data) {
    const report = data.files[0];
    const verdict = report.valid ? "valid" : "invalid";
    const counts = `: ${report.errors.length} error(s), ${report.warnings.length} warning(s)`;
    const nodes = [el("p", { id: "verdict", class: verdict }, el("strong", {}, verdict.toUpperCase()), " ",
      el("span", { class: "path" }, report.path), counts)];
    const rows = report.errors.map((f) => ["error", f]).concat(report.warnings.map((f) => ["warning", f]));
    if (rows.length === 0) nodes.push(el("p", {}, "No findings."));
    else nodes.push(table("findings", "Findings", ["Rule", "Severity", "Entry", "Message", "Fix"],
      rows.map(([sev, f]) => el("tr", { class: sev }, el("td", {}, el("code", {}, f.code)), el("td", {}, sev),
        el("td", {}, f.entry || ""), el("td", {}, f.message), el("td", {}, (fixes && fixes[f.code]) || "")))));
    if (data.info) {
      const comps = Object.entries(data.info.components || {});
      nodes.push(table("components", "Components", ["Component", "Class", "Dtype", "Parameters", "Bytes", "References"],
        comps.map(([name, c]) => el("tr", {}, el("th", { scope: "row" }, name), el("td", {}, String(c.class)),
          el("td", {}, c.dtype || "-"), el("td", {}, (c.parameters || 0).toLocaleString("en-US")),
          el("td", {}, (c.bytes || 0).toLocaleString("en-US")), el("td", {}, reference(c))))));
    }
    result.replaceChildren(...nodes);
  }

  function failure(message) {
    result.replaceChildren(el("p", { id: "verdict", class: "invalid", role: "alert" }, "Not checked: " + message));
  }

  async function loadFixes() {
    if (fixes) return;
    const response = await fetch("/v1/rules");
    fixes = Object.fromEntries((await response.json()).rules.map((r) => [r.code, r.fix]));
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const params = new URLSearchParams();
    for (const name of ["verify", "strict"]) if (form.elements[name].checked) params.set(name, "true");
    const file = fileInput.files[0];
    const url = form.elements.url.value.trim();
    let init;
    if (file) {
      const body = new FormData();
      body.append("file", file, file.name);
      init = { method: "POST", body };
    } else if (url) {
      init = { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ url }) };
    } else {
      failure("choose a file or paste a URL");
      return;
    }
    result.replaceChildren(el("p", { role: "status" }, "Checking…"));
    try {
      await loadFixes();
      const response = await fetch("/v1/validate?" + params, init);
      const data = await response.json();
      if (!response.ok) failure(data.error || `HTTP ${response.status}`);
      else render(data);
    } catch (e) {
      failure(String(e));
    }
  });

  for (const name of ["dragenter", "dragover"]) drop.addEventListener(name, (e) => { e.preventDefault(); drop.classList.add("over"); });
  for (const name of ["dragleave", "drop"]) drop.addEventListener(name, () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    if (e.dataTransfer && e.dataTransfer.files.length) fileInput.files = e.dataTransfer.files;
  });
})();
