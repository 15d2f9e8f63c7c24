// The page without a framework: posts to /v1/validate and renders the same markup as the server-side
// fallback (dduf_plus/serve/page.py). Archive content is only ever set as text (textContent), never as HTML.
"use strict";
(function () {
  const form = document.getElementById("check");
  const result = document.getElementById("result");
  const drop = document.getElementById("drop");
  const fileInput = document.getElementById("file");
  let rules = null; // code -> {title, fix}, from /v1/rules
  let labels = null; // {severities: {error: {label, plural}}, verdicts: {valid, invalid}}: the CLI's words, from /v1/rules

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

  const MAX_LISTED = 50; // as page.py: entries named in one findings row

  function reference(c) {
    const ref = c.external;
    if (!ref) return "in archive";
    let where = ref.pretrained_model_name_or_path || "(passed by the caller)";
    if (ref.subfolder) where += "/" + ref.subfolder;
    return where + (ref.revision ? "@" + ref.revision : "");
  }

  function sizes(c) { // as page.py: a referenced component shows what its reference records, not 0
    const n = (v) => (v || 0).toLocaleString("en-US");
    const ref = c.external;
    if (!ref) return [n(c.parameters), n(c.bytes)];
    const files = ref.files && typeof ref.files === "object" ? Object.values(ref.files) : [];
    const size = files.reduce((t, r) => t + (r && Number.isInteger(r.size) ? r.size : 0), 0);
    return ["referenced", files.length ? n(size) + " (referenced)" : "referenced"];
  }

  function rich(text) { // a rule's `backquoted` spans as <code>, the rest as text
    const parts = String(text).split("`");
    if (parts.length % 2 === 0) parts.splice(-2, 2, parts[parts.length - 2] + "`" + parts[parts.length - 1]);
    return parts.map((p, i) => (i % 2 ? el("code", {}, p) : document.createTextNode(p)));
  }

  function bySeverity(report) { // [severity, finding] for errors, warnings, infos (page.py's _by_severity)
    return Object.entries(labels.severities).flatMap(([sev, s]) => (report[s.plural] || []).map((f) => [sev, f]));
  }

  function counts(report) { // "0 errors, 1 warning, 2 infos", as page.py's counts and the CLI
    return Object.values(labels.severities).map((s) => {
      const n = (report[s.plural] || []).length;
      return `${n} ${n === 1 ? s.label : s.plural}`;
    }).join(", ");
  }

  function groups(report) { // as dduf_plus.format.findings.group_findings: one row per (severity, rule)
    const found = new Map();
    const all = bySeverity(report);
    for (const [sev, f] of all) {
      const key = sev + " " + f.code;
      if (!found.has(key)) found.set(key, { sev, code: f.code, findings: [] });
      found.get(key).findings.push(f);
    }
    return [...found.values()];
  }

  function findingRow(g) {
    const entries = [...new Set(g.findings.map((f) => f.entry).filter((e) => e))];
    let listed = entries.slice(0, MAX_LISTED).join(", ");
    if (entries.length > MAX_LISTED) listed += ` and ${entries.length - MAX_LISTED} more`;
    const same = new Set(g.findings.map((f) => f.message)).size <= 1;
    const rule = rules && rules[g.code];
    const message = el("td", {}, same || !rule ? g.findings[0].message : rule.title);
    if (!same) message.append(el("ul", {}, ...g.findings.slice(0, MAX_LISTED).map((f) => el("li", {}, `${f.entry || ""}: ${f.message}`))));
    const code = el("td", {}, el("code", {}, g.code));
    if (g.findings.length > 1) code.append(` (${g.findings.length})`);
    return el("tr", { class: g.sev }, code, el("td", {}, labels.severities[g.sev].label), el("td", {}, listed), message,
      el("td", {}, ...(rule ? rich(rule.fix) : [])));
  }

  function render(data) {
    const report = data.files[0];
    const verdict = report.valid ? "valid" : "invalid";
    const nodes = [el("p", { id: "verdict", class: verdict }, el("strong", {}, labels.verdicts[verdict]), " ",
      el("span", { class: "path" }, report.path), ": " + counts(report))];
    const rows = groups(report);
    if (rows.length === 0) nodes.push(el("p", {}, "No findings."));
    else nodes.push(table("findings", "Findings", ["Rule", "Severity", "Entries", "Message", "Fix"], rows.map(findingRow)));
    if (data.info) {
      const comps = Object.entries(data.info.components || {});
      nodes.push(table("components", "Components", ["Component", "Class", "Dtype", "Parameters", "Bytes", "References"],
        comps.map(([name, c]) => el("tr", {}, el("th", { scope: "row" }, name), el("td", {}, String(c.class)),
          el("td", {}, c.dtype || "-"), ...sizes(c).map((v) => el("td", {}, v)), el("td", {}, reference(c))))));
      const adapters = data.info.adapters || [];
      if (adapters.length) nodes.push(table("adapters", "LoRA adapters", ["Adapter", "Layout", "Weight", "Targets", "Trainer metadata"],
        adapters.map((a) => el("tr", {}, el("th", { scope: "row" }, a.name), el("td", {}, String(a.layout)),
          el("td", {}, String(a.weight)), el("td", {}, adapterTargets(a)), el("td", {}, adapterMetadata(a))))));
    }
    result.replaceChildren(...nodes);
  }

  function adapterTargets(a) {
    return Object.entries(a.targets || {}).map(([c, t]) => `${c}: ${t.modules} modules, rank ${(t.ranks || []).join("/")}`).join("; ");
  }

  function adapterMetadata(a) {
    const m = a.metadata || {};
    const words = (a.trigger_words || []).length ? ["trigger words: " + a.trigger_words.join(", ")] : [];
    return ["modelspec.title", "modelspec.architecture", "ss_base_model_version"].filter((k) => k in m)
      .map((k) => `${k}: ${m[k]}`).concat(words).join("; ") || "-";
  }

  function failure(message) {
    result.replaceChildren(el("p", { id: "verdict", class: "invalid", role: "alert" }, "Not checked: " + message));
  }

  async function loadRules() {
    if (rules) return;
    const response = await fetch("/v1/rules");
    const data = await response.json();
    rules = Object.fromEntries(data.rules.map((r) => [r.code, r]));
    labels = { severities: data.severities, verdicts: data.verdicts };
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
      await loadRules();
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
