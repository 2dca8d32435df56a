// polar view: the page. Every node is built with el() below, which sets text through textContent and
// createTextNode only: what a harness or a model wrote is shown as text and never parsed as HTML.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const ROW_LIMIT = 500;      // task rows drawn at once; the filters narrow the rest
const BLOCK_TOKENS = 256;   // tokens per lazily drawn block of the token view
const state = { filters: { min: "", max: "", status: "", harness: "", search: "" }, stamp: "", route: "" };

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
  }
  return node;
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) node.appendChild(typeof child === "string" ? document.createTextNode(child) : child);
  return node;
}

const fmt = (v, digits = 3) => (v === null || v === undefined || v === "" ? "–" : typeof v === "number" ? (Number.isInteger(v) ? String(v) : v.toFixed(digits)) : String(v));
const secs = (v) => (v ? `${v.toFixed(2)} s` : "–");
const link = (href, text, cls) => el("a", { href, class: cls }, text);
// A session's advantage, or "left out" (why: on hover) where the trainer's screening left it out.
const advantageCell = (s) => s.left_out
  ? el("td", { class: "num left-out", title: s.left_out, text: "left out" })
  : el("td", { class: "num", text: fmt(s.advantage) });
const enc = encodeURIComponent;

async function getJSON(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  const body = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
  if (!response.ok) throw new Error(body.error || `HTTP ${response.status}`);
  return body;
}

function setMain(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== false));
}

function crumbs(...items) {
  const nav = document.getElementById("crumbs");
  const parts = [link("#/", "run")];
  for (const [href, text] of items) parts.push(" › ", href ? link(href, text) : el("span", { text }));
  nav.replaceChildren(...parts);
}

function problem(text) { return text ? el("p", { class: "problem" }, text) : null; }

// ------------------------------------------------------------------------------------------- plots

function plot(key, label, steps) {
  const points = steps.filter((s) => typeof s[key] === "number").map((s) => [s.step, s[key]]);
  const box = el("div", { class: "plot-box" }, el("h3", { text: label }));
  const W = 300, H = 150, L = 40, R = 8, T = 8, B = 20;
  const chart = svg("svg", { class: "plot", "data-key": key, viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
  chart.appendChild(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  chart.appendChild(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  if (points.length) {
    const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
    let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { y0 -= 1; y1 += 1; }
    const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
    chart.appendChild(svg("polyline", { class: "line", points: points.map(([x, y]) => `${X(x)},${Y(y)}`).join(" ") }));
    for (const [x, y] of points) {
      const dot = svg("a", { href: `#/step/${x}`, class: "point", "data-step": x }, svg("circle", { cx: X(x), cy: Y(y), r: 5 }));
      dot.appendChild(svg("title", {}, `step ${x}: ${fmt(y, 4)} (open the step)`));
      chart.appendChild(dot);
    }
    chart.appendChild(svg("text", { x: 2, y: T + 8 }, fmt(y1, 3)));
    chart.appendChild(svg("text", { x: 2, y: H - B }, fmt(y0, 3)));
    chart.appendChild(svg("text", { x: L, y: H - 4 }, `step ${x0}`));
    chart.appendChild(svg("text", { x: W - R - 50, y: H - 4 }, `step ${x1}`));
  }
  box.appendChild(chart);
  return box;
}

// ---------------------------------------------------------------------------------------- overview

function taskRows(tasks, sessionIds) {
  const f = state.filters;
  const needle = f.search.trim();
  const matchingSessions = needle ? new Set(sessionIds.filter((id) => id.includes(needle)).map((id) => id.slice(0, id.lastIndexOf(".")))) : null;
  return tasks.filter((t) => {
    if (f.status && t.status !== f.status) return false;
    if (f.harness && t.harness !== f.harness) return false;
    if (f.min !== "" && !(t.mean_reward !== null && t.mean_reward >= Number(f.min))) return false;
    if (f.max !== "" && !(t.mean_reward !== null && t.mean_reward <= Number(f.max))) return false;
    if (needle && !t.task_id.includes(needle) && !matchingSessions.has(t.task_id)) return false;
    return true;
  });
}

function taskTable(tasks, sessionIds) {
  const rows = taskRows(tasks, sessionIds);
  const table = el("table", { id: "tasks" },
    el("tr", {}, ["task", "status", "sessions", "mean reward", "harness"].map((h) => el("th", { text: h }))));
  for (const t of rows.slice(0, ROW_LIMIT)) {
    const states = Object.entries(t.states || {}).map(([k, v]) => `${k} ${v}`).join(", ");
    table.appendChild(el("tr", { class: "task-row", "data-task": t.task_id },
      el("td", {}, link(`#/task/${enc(t.task_id)}`, t.task_id)), el("td", { text: t.status }),
      el("td", { text: `${t.group_size} (${states})` }), el("td", { class: "num", text: fmt(t.mean_reward) }),
      el("td", { text: t.harness || "" })));
  }
  const more = rows.length > ROW_LIMIT ? el("p", { class: "note", text: `${rows.length - ROW_LIMIT} more tasks match: narrow the filters` }) : null;
  const exact = sessionIds.includes(state.filters.search.trim()) ? el("p", {}, "session ", link(`#/session/${enc(state.filters.search.trim())}`, state.filters.search.trim())) : null;
  return el("div", { id: "task-list" }, el("p", { class: "note", text: `${rows.length} of ${tasks.length} tasks` }), exact, table, more);
}

function filterBar(tasks, sessionIds, redraw) {
  const f = state.filters;
  const input = (key, attrs) => el("input", { ...attrs, value: f[key], oninput: (e) => { f[key] = e.target.value; redraw(); } });
  const select = (key, options) => {
    const node = el("select", { id: `filter-${key}`, onchange: (e) => { f[key] = e.target.value; redraw(); } },
      el("option", { value: "", text: "any" }), options.map((o) => el("option", { value: o, text: o })));
    node.value = f[key];
    return node;
  };
  const harnesses = [...new Set(tasks.map((t) => t.harness).filter(Boolean))].sort();
  return el("div", { class: "filters" },
    el("label", {}, "search ", input("search", { id: "search", type: "search", placeholder: "task or session id" })),
    el("label", {}, "reward ≥ ", input("min", { id: "filter-min", type: "number", step: "any" })),
    el("label", {}, "≤ ", input("max", { id: "filter-max", type: "number", step: "any" })),
    el("label", {}, "status ", select("status", ["released", "running", "pending"])),
    el("label", {}, "harness ", select("harness", harnesses)));
}

async function showOverview() {
  const data = await getJSON("/api/overview");
  document.getElementById("source").textContent = data.source + (data.run_dir ? ` · run ${data.run_dir}` : "");
  crumbs();
  const plots = data.steps.length
    ? el("div", { class: "plots", id: "plots" }, data.plotted.map(([key, label]) => plot(key, label, data.steps)))
    : null;
  const list = el("div", {});
  const redraw = () => list.replaceChildren(taskTable(data.tasks, data.session_ids));
  redraw();
  const empty = !data.tasks.length ? el("p", { class: "note", id: "no-tasks", text: "No tasks yet." }) : null;
  setMain(el("h1", { text: "Run" }), problem(data.run_problem), plots,
    data.steps.length ? el("p", { class: "note", text: "Click a point to open its step: the groups it trained on." }) : null,
    el("h2", { text: "Tasks and groups" }), problem(data.problem), empty,
    data.tasks.length ? filterBar(data.tasks, data.session_ids, redraw) : null, list);
}

// ---------------------------------------------------------------------------------- step and task

function sessionTable(group) {
  const table = el("table", { class: "sessions", "data-task": group.task_id },
    el("tr", {}, ["session", "state", "outcome", "reward", "advantage", "attempts", "calls", "harness", "running", "error"].map((h) => el("th", { text: h }))));
  for (const s of group.sessions || []) {
    table.appendChild(el("tr", { "data-session": s.session_id },
      el("td", {}, link(`#/session/${enc(s.session_id)}`, s.session_id, "session-link")), el("td", { text: s.state }),
      el("td", { text: s.outcome }), el("td", { class: "num", text: fmt(s.reward) }),
      advantageCell(s), el("td", { class: "num", text: fmt(s.attempts) }),
      el("td", { class: "num", text: fmt(s.calls) }), el("td", { text: s.harness || "" }),
      el("td", { class: "num", text: secs((s.timings || {}).running) }), el("td", { text: s.error || "" })));
  }
  return table;
}

function groupSection(group) {
  if (group.missing) return el("section", {}, el("h2", { text: group.task_id }), el("p", { class: "problem", text: "this task is not in the rollout store read" }));
  return el("section", { class: "group" },
    el("h2", {}, link(`#/task/${enc(group.task_id)}`, group.task_id), ` · ${group.status} · mean reward ${fmt(group.mean_reward)}`),
    group.instruction ? el("p", { class: "note", text: group.instruction }) : null, sessionTable(group));
}

async function showStep(number) {
  const data = await getJSON(`/api/step/${enc(number)}`);
  crumbs([null, `step ${number}`]);
  const facts = el("dl", { class: "facts" }, Object.entries(data.metrics).flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: fmt(v, 4) })]));
  setMain(el("h1", { text: `Step ${number}` }), el("details", {}, el("summary", { text: "metrics" }), facts),
    data.dropped.length ? el("p", { class: "note", text: `dropped groups: ${data.dropped.join(", ")}` }) : null,
    data.groups.map(groupSection));
}

async function showTask(taskId) {
  const data = await getJSON(`/api/task/${enc(taskId)}`);
  crumbs([null, `task ${taskId}`]);
  setMain(el("h1", { text: `Task ${taskId}` }), groupSection(data));
}

// ------------------------------------------------------------------------------------------ session

function partNode(p) {
  const label = { text: "", thinking: "thinking", tool_call: `tool call ${p.name}`, tool_result: `tool result${p.name ? " " + p.name : ""}`, other: "other" }[p.kind] || p.kind;
  return el("div", { class: `part kind-${p.kind}` }, label ? el("span", { class: "label", text: label + (p.id ? ` (${p.id})` : "") }) : null, el("pre", { text: p.text }));
}

function turnNode(t) {
  return el("div", { class: `turn role-${t.role}` }, el("div", { class: "role", text: t.role }), (t.parts || []).map(partNode));
}

function callBody(call) {
  const nodes = [];
  if (call.system !== null) nodes.push(el("details", {}, el("summary", { text: `system (${call.system.length} characters)` }), el("pre", { class: "out", text: call.system })));
  else nodes.push(el("p", { class: "note", text: "system as in the call before" }));
  if (call.tools !== null) nodes.push(el("p", { class: "note", text: `tools: ${call.tools.join(", ") || "none"}` }));
  if (call.shared_turns) nodes.push(el("p", { class: "note shared", text: `${call.shared_turns} earlier turns as in the call before (prompt shown as the difference)` }));
  nodes.push(call.turns.map(turnNode));
  nodes.push(el("div", { class: "reply" }, el("div", { class: "label note", text: `reply (${call.reply_source})` }), call.reply.map(turnNode)));
  return nodes;
}

function callNode(call, sessionId, observer) {
  const badges = [];
  if (call.truncated) badges.push(el("span", { class: "badge warn", text: "truncated" }));
  if (call.aborted) badges.push(el("span", { class: "badge warn", text: "aborted" }));
  if (call.prompt_too_long) badges.push(el("span", { class: "badge bad", text: "prompt too long" }));
  if (call.error) badges.push(el("span", { class: "badge bad", text: `error: ${call.error}` }));
  if (call.bodies_dropped) badges.push(el("span", { class: "badge warn", text: "bodies dropped" }));
  const s = call.sampling, t = call.timings;
  // top_p 0 or 1 and top_k 0 mean no truncation (the contract's zero values): shown only when set.
  const truncation = `${s.top_p > 0 && s.top_p < 1 ? ` top_p ${fmt(s.top_p, 2)}` : ""}${s.top_k > 0 ? ` top_k ${s.top_k}` : ""}`;
  const sampling = `T ${fmt(s.temperature, 2)}${truncation} max ${s.max_tokens}${s.seed !== null ? ` seed ${s.seed}` : ""}${s.constraint ? ` constraint ${s.constraint}` : ""}`;
  const head = el("div", { class: "head" },
    el("strong", { text: call.call_id }), el("span", { class: "dialect", text: call.dialect }),
    el("span", { text: `finish ${call.finish}` }),
    el("span", { text: `prompt ${call.prompt_tokens} (cached ${call.cached_tokens}) · sampled ${call.sampled_tokens}` }),
    el("span", { text: `v${call.policy_version}${call.last_policy_version !== call.policy_version ? "–" + call.last_policy_version : ""}` }),
    el("span", { text: `total ${secs(t.total)} · first token ${secs(t.first_token)} · queue ${secs(t.queue)}` }),
    el("span", { class: "note", text: sampling }),
    call.extends ? el("span", { class: "note", text: `extends ${call.extends}` }) : null,
    call.trace_id ? link(`#/session/${enc(sessionId)}/trace/${enc(call.trace_id)}`, `tokens (${call.trace_id})`, "trace-link") : null,
    badges);
  const body = el("div", { class: "body" });
  body.render = () => body.replaceChildren(...callBody(call).flat());
  observer.observe(body);
  return el("div", { class: "call", "data-call": call.call_id, "data-dialect": call.dialect }, head, body);
}

function lazyObserver() {
  return new IntersectionObserver((entries, observer) => {
    for (const entry of entries) {
      if (entry.isIntersecting) { observer.unobserve(entry.target); entry.target.render(); }
    }
  }, { rootMargin: "600px 0px" });
}

function forkTree(data) {
  const children = {};
  for (const t of data.traces) (children[t.parent] = children[t.parent] || []).push(t);
  const branch = (parent) => el("ul", {}, (children[parent] || []).map((t) => el("li", { "data-trace": t.trace_id },
    link(`#/session/${enc(data.session_id)}/trace/${enc(t.trace_id)}`, t.trace_id, "trace-link"),
    ` ${t.fork_reason ? "forked by " + t.fork_reason : "first chain"} · ${t.tokens} tokens, ${t.trainable} trained · weight ${fmt(t.weight)}` +
      ` · calls ${t.calls.join(", ")}${t.truncated ? " · truncated" : ""}`, branch(t.trace_id))));
  return el("div", { class: "tree", id: "forks" }, branch(""));
}

async function showSession(sessionId) {
  const data = await getJSON(`/api/session/${enc(sessionId)}`);
  if (data.pending) {
    const s = data.summary;
    crumbs([`#/task/${enc(s.task_id)}`, `task ${s.task_id}`], [null, sessionId]);
    setMain(el("h1", { text: `Session ${sessionId}` }), el("p", { class: "note", text: `not released yet: ${s.state}, ${s.calls} calls so far` }));
    return;
  }
  crumbs([`#/task/${enc(data.task_id)}`, `task ${data.task_id}`], [null, sessionId]);
  const facts = [["task", link(`#/task/${enc(data.task_id)}`, data.task_id)], ["reward", fmt(data.reward)], ["advantage", fmt(data.advantage)],
    ["outcome", data.outcome], ["harness", data.harness], ["attempt", fmt(data.attempt)], ["harness exit code", fmt(data.harness_exit_code)],
    ["builder", data.builder], ["policy versions", data.policy_versions.join("–")],
    ["stages", Object.entries(data.timings).map(([k, v]) => `${k} ${secs(v)}`).join(" · ")],
    ["calls", `${data.calls.length}${data.abandoned_calls ? ` (+${data.abandoned_calls} abandoned)` : ""}`]];
  if (data.error) facts.push(["error", data.error]);
  if (data.left_out) facts.push(["screening", el("span", { class: "left-out", id: "left-out", text: data.left_out })]);
  const verifyNode = data.verify.ok
    ? el("p", { class: "passed", id: "verify", text: "polar verify: ok (every trained token is what the engine sampled)" })
    : el("div", { class: "failed", id: "verify" }, el("strong", { text: `polar verify would fail: ${data.verify.count} problems` }),
      el("ul", {}, data.verify.problems.map((p) => el("li", { text: p }))));
  const observer = lazyObserver();
  setMain(el("h1", { text: `Session ${sessionId}` }),
    el("dl", { class: "facts" }, facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", {}, v)])), verifyNode,
    el("h2", { text: "Traces (forks)" }), forkTree(data),
    el("h2", { text: "Calls" }), el("div", { id: "calls" }, data.calls.map((c) => callNode(c, data.session_id, observer))),
    el("h2", { text: "Harness output" }), el("pre", { class: "out", id: "harness-output", text: data.harness_output || "(none)" }),
    el("h2", { text: "Evaluator log" }), el("pre", { class: "out", id: "evaluator-output", text: data.evaluator_output || "(none)" }));
}

// ------------------------------------------------------------------------------------------- tokens

function logprobColour(lp) {
  // 0 nats green, -5 yellow, -10 and below red
  const hue = Math.max(0, Math.min(120, 120 + lp * 12));
  return `hsl(${hue}, 65%, 80%)`;
}

function tokenBlock(data, start, end, bad, segmentAt) {
  const block = el("div", { class: "block", "data-start": start, "data-end": end });
  block.style.minHeight = `${Math.ceil((end - start) / 24) * 1.7}em`;
  block.render = () => {
    const nodes = [];
    for (let i = start; i < end; i++) {
      const seg = segmentAt[i];
      if (seg) nodes.push(el("span", { class: `seg-mark ${seg.kind}`, text: `${seg.kind} ${seg.call_id}` }));
      const sampled = data.loss_mask[i] === 1;
      const text = data.pieces ? data.pieces[i] : `[${data.token_ids[i]}]`;
      const problem = bad.get(i);
      const title = `position ${i} · id ${data.token_ids[i]} · mask ${data.loss_mask[i]}` +
        (sampled ? ` · logprob ${data.logprobs[i]} · advantage ${fmt(data.advantage)}` : "") + (problem ? ` · ${problem}` : "");
      const span = el("span", { class: `tok ${sampled ? "sampled" : "prompt"}${problem ? " bad" : ""}`, "data-i": i, "data-mask": data.loss_mask[i], title, text });
      if (sampled) span.style.background = logprobColour(data.logprobs[i]);
      nodes.push(span);
    }
    block.replaceChildren(...nodes);
    block.style.minHeight = "";
    block.dataset.rendered = "1";
  };
  return block;
}

async function showTrace(sessionId, traceId) {
  const data = await getJSON(`/api/session/${enc(sessionId)}/trace/${enc(traceId)}`);
  crumbs([`#/session/${enc(sessionId)}`, `session ${sessionId}`], [null, `trace ${traceId}`]);
  const bad = new Map(data.bad.map((b) => [b.position, b.message]));
  const segmentAt = {};
  for (const s of data.segments) segmentAt[s.start] = s;
  const trained = data.loss_mask.reduce((a, b) => a + b, 0);
  const observer = lazyObserver();
  const area = el("div", { class: "tokens", id: "tokens", "data-count": data.token_ids.length });
  for (let start = 0; start < data.token_ids.length; start += BLOCK_TOKENS) {
    const block = tokenBlock(data, start, Math.min(start + BLOCK_TOKENS, data.token_ids.length), bad, segmentAt);
    area.appendChild(block);
    observer.observe(block);
  }
  const verifyNode = data.bad.length || data.problems.length
    ? el("div", { class: "failed", id: "verify" }, el("strong", { text: `polar verify would fail here: ${data.bad.length + data.problems.length} problems` }),
      el("ul", {}, [...data.problems, ...data.bad.slice(0, 50).map((b) => b.message)].map((p) => el("li", {}, p))))
    : el("p", { class: "passed", id: "verify", text: "polar verify: ok for this trace" });
  setMain(el("h1", { text: `Trace ${traceId} of ${sessionId}` }),
    el("p", {}, `${data.token_ids.length} tokens, ${trained} trained (loss mask 1) · advantage ${fmt(data.advantage)} · weight ${fmt(data.weight)}` +
      `${data.fork_reason ? " · forked by " + data.fork_reason : ""}${data.truncated ? " · truncated" : ""}`),
    data.left_out ? el("p", { class: "left-out", id: "left-out", text: `not trained on: ${data.left_out}` }) : null,
    verifyNode,
    el("div", { class: "legend" }, el("span", { class: "tok prompt", text: "prompt (mask 0)" }), el("span", { class: "tok sampled", text: "sampled (mask 1, underlined)" }),
      el("span", {}, "log-probability: −10 ", el("span", { class: "scale" }), " 0"), el("span", { class: "tok bad", text: "not what the engine sampled" })),
    data.pieces ? null : el("p", { class: "note", text: data.tokenizer_problem || "no tokenizer (polar view --model): tokens shown as ids" }),
    area);
}

// ------------------------------------------------------------------------------------------ routing

async function route(quiet) {
  const hash = location.hash || "#/";
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  const changedRoute = hash !== state.route;
  state.route = hash;
  try {
    if (parts[0] === "step") await showStep(parts[1]);
    else if (parts[0] === "task") await showTask(parts[1]);
    else if (parts[0] === "session" && parts[2] === "trace") { if (!quiet || changedRoute) await showTrace(parts[1], parts[3]); }
    else if (parts[0] === "session") { if (!quiet || changedRoute) await showSession(parts[1]); }
    else await showOverview();
  } catch (error) {
    if (!quiet) setMain(el("p", { class: "problem", text: `Could not load this page: ${error.message}` }));
  }
}

function follow() {
  const live = document.getElementById("live");
  const events = new EventSource("/api/events");
  events.addEventListener("changed", (event) => {
    live.textContent = "● live";
    live.className = "on";
    const stamp = JSON.parse(event.data);
    if (state.stamp && stamp !== state.stamp) {
      const y = window.scrollY;
      route(true).then(() => window.scrollTo(0, y));
    }
    state.stamp = stamp;
  });
  events.onerror = () => { live.textContent = "○ disconnected"; live.className = ""; };
}

window.addEventListener("hashchange", () => route(false));
route(false);
follow();
