// The playground: streams one request with diffusion.stream_drafts and draws each canvas as a grid of
// cells that fill in as drafts arrive (drafts are SSE comment lines ": draft {json}", see
// deployments/drafts.py); committed tokens turn their cells green. Every draft and commit is kept, so
// the replay slider redraws the request at any point of its history. URLs are relative: the page
// works under any Serve route prefix.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  model: null, canvasLength: 32, controller: null,
  events: [],           // in arrival order: {draft} or {tokens, text}
  drafts: [],           // {canvas, step, masked} of every draft received (tests read this)
  rows: new Map(),      // what is drawn: canvas index -> {box, tag, cells}
  committed: 0,         // output tokens drawn as committed
  started: 0, firstToken: null,
};
window.dllmPlayground = state;

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("v1/models", { headers: headers() });
    if (!r.ok) throw new Error(r.status === 401 ? "this server needs an API key" : `HTTP ${r.status}`);
    const card = (await r.json()).data[0];
    state.model = card.id;
    state.canvasLength = card.canvas_length || 32;
    $("model").textContent = `${card.id} · canvas ${state.canvasLength} · max_model_len ${card.max_model_len}`;
  } catch (err) {
    $("model").textContent = `model unknown: ${err.message}`;
  }
}

function setStatus(text, s) {
  $("status").textContent = text;
  $("status").dataset.state = s;
}

// special tokens (<bos>, <SPECIAL_7>, ...) and raw bytes are drawn dimmer than text
const special = (token) => token !== null && (/^<[^<>\s]+>$/.test(token) || token.startsWith("bytes:"));

function show(token) {
  if (token === null) return "·";
  return token.replace(/^bytes:/, "").replace(/\n/g, "↵").replace(/\t/g, "⇥");
}

// ---- drawing: the grid and the text as of some prefix of the events --------------------------------

function clear() {
  state.rows.clear();
  state.committed = 0;
  $("canvases").replaceChildren();
  $("text").textContent = "";
}

function row(canvas) {
  let r = state.rows.get(canvas);
  if (r) return r;
  const box = document.createElement("div");
  box.className = "canvas";
  const tag = document.createElement("div");
  tag.className = "tag";
  tag.textContent = `canvas ${canvas}`;
  const grid = document.createElement("div");
  grid.className = "grid";
  const cells = [];
  for (let j = 0; j < state.canvasLength; j++) {
    const c = document.createElement("span");
    c.className = "cell masked";
    c.textContent = "·";
    grid.appendChild(c);
    cells.push(c);
  }
  box.append(tag, grid);
  // a draft of the next canvas can come before this one's commit: keep the rows in canvas order
  const after = [...state.rows.keys()].filter((k) => k > canvas).sort((a, b) => a - b)[0];
  $("canvases").insertBefore(box, after === undefined ? null : state.rows.get(after).box);
  r = { box, tag, cells };
  state.rows.set(canvas, r);
  return r;
}

function drawDraft(d) {
  const r = row(d.canvas);
  const revealed = new Set(d.revealed);
  r.tag.textContent = `canvas ${d.canvas} · step ${d.step}`;
  d.tokens.forEach((t, j) => {
    const cell = r.cells[j];
    if (!cell || cell.classList.contains("committed")) return;
    cell.textContent = show(d.cells[j]);
    cell.title = t === null ? "masked" : `${JSON.stringify(d.cells[j])} (id ${t})`;
    cell.className = "cell " + (t === null ? "masked" : revealed.has(j) ? "revealed" : "known");
    if (special(d.cells[j])) cell.classList.add("special");
  });
}

function drawTokens(tokens, text) {
  $("text").textContent += text;
  for (const token of tokens) {
    const p = state.committed++;
    const r = row(Math.floor(p / state.canvasLength));
    const cell = r.cells[p % state.canvasLength];
    cell.textContent = show(token);
    cell.title = JSON.stringify(token);
    cell.className = "cell committed";
    if (special(token)) cell.classList.add("special");
  }
}

function draw(ev) {
  if (ev.draft) drawDraft(ev.draft);
  else drawTokens(ev.tokens, ev.text);
}

function markUnused() {
  // positions of the last canvas past the end of the output (max_tokens, a stop) were never committed
  for (const r of state.rows.values())
    for (const cell of r.cells) if (!cell.classList.contains("committed")) cell.className = "cell unused";
}

function replay(upto) {
  clear();
  state.events.slice(0, upto).forEach(draw);
  if (upto === state.events.length) markUnused();
  $("replay-at").textContent = `${upto} / ${state.events.length} events`;
}

// ---- the stream -------------------------------------------------------------------------------------

function record(ev) {
  state.events.push(ev);
  draw(ev);
}

function onDraft(d) {
  state.drafts.push({ canvas: d.canvas, step: d.step, masked: d.tokens.filter((t) => t === null).length });
  $("m-drafts").textContent = state.drafts.length;
  record({ draft: d });
}

function onChunk(c, chat) {
  if (c.error) throw new Error(c.error.message);
  if (c.usage) {
    const u = c.usage, d = u.diffusion || {};
    $("m-tokens").textContent = u.completion_tokens;
    $("m-canvases").textContent = d.canvases ?? "–";
    $("m-spc").textContent = d.steps_per_canvas == null ? "–" : d.steps_per_canvas.toFixed(2);
    $("m-tps").textContent = d.tokens_per_step == null ? "–" : d.tokens_per_step.toFixed(2);
  }
  const choice = c.choices && c.choices[0];
  if (!choice) return;
  const lp = choice.logprobs;
  const tokens = !lp ? [] : chat ? (lp.content || []).map((t) => t.token) : lp.tokens;
  if (tokens.length && state.firstToken === null) {
    state.firstToken = performance.now();
    $("m-ttft").textContent = `${(state.firstToken - state.started).toFixed(0)} ms`;
  }
  record({ tokens, text: (chat ? choice.delta.content : choice.text) || "" });
  $("m-tokens").textContent = state.committed;
}

function requestBody(chat) {
  const mode = $("mode").value;
  const diffusion = { mode };
  if (mode === "diffusion") {
    Object.assign(diffusion, { stream_drafts: true, draft_every: Number($("draft_every").value) || 4,
                               policy: $("policy").value, threshold: Number($("threshold").value) });
    if ($("steps").value) diffusion.max_denoising_steps = Number($("steps").value);
  }
  const body = { model: state.model, temperature: Number($("temperature").value), stream: true,
                 stream_options: { include_usage: true }, ignore_eos: $("ignore_eos").checked, diffusion };
  if ($("seed").value) body.seed = Number($("seed").value);
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try { parsed = JSON.parse(schema); } catch (err) { throw new Error(`the JSON schema is not JSON: ${err.message}`); }
    body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: parsed } };
  }
  const n = Number($("max_tokens").value) || 64;
  if (chat) Object.assign(body, { messages: [{ role: "user", content: $("prompt").value }], max_completion_tokens: n,
                                  logprobs: true });
  else Object.assign(body, { prompt: $("prompt").value, max_tokens: n, logprobs: 0 });
  return body;
}

async function readStream(response, chat) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (line.startsWith(": draft ")) onDraft(JSON.parse(line.slice(8)));
        else if (line.startsWith("data: ") && line !== "data: [DONE]") onChunk(JSON.parse(line.slice(6)), chat);
      }
    }
  }
}

async function generate(event) {
  event.preventDefault();
  if (!state.model) await loadModel();
  const chat = $("endpoint").value === "chat";
  clear();
  state.events = [];
  state.drafts = [];
  state.firstToken = null;
  for (const id of ["m-ttft", "m-spc", "m-tps", "m-canvases", "m-tokens", "m-drafts", "m-time"]) $(id).textContent = "–";
  $("replay-box").hidden = true;
  state.controller = new AbortController();
  $("go").disabled = true;
  $("stop").disabled = false;
  setStatus("running…", "running");
  state.started = performance.now();
  try {
    const body = requestBody(chat);
    const r = await fetch(chat ? "v1/chat/completions" : "v1/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? `${r.status}: ${err.error.message}` : `HTTP ${r.status}`);
    }
    await readStream(r, chat);
    setStatus("done", "done");
  } catch (err) {
    const stopped = err.name === "AbortError";
    setStatus(stopped ? "stopped" : `error: ${err.message}`, stopped ? "stopped" : "error");
  } finally {
    markUnused();
    $("m-time").textContent = `${((performance.now() - state.started) / 1000).toFixed(2)} s`;
    $("replay").max = state.events.length;
    $("replay").value = state.events.length;
    $("replay-at").textContent = `${state.events.length} / ${state.events.length} events`;
    $("replay-box").hidden = state.events.length === 0;
    $("go").disabled = false;
    $("stop").disabled = true;
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("replay").addEventListener("input", () => replay(Number($("replay").value)));
loadModel();
