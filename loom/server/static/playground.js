// loom playground: chat over POST /v1/chat/completions with "stream": true, read as
// server-sent events from fetch()'s ReadableStream; server load polled from GET /v1/loom/stats.
// A model without a chat template (GET /tokenizer_info says null: a base model) gets completion
// mode instead: the system text and the turns so far, joined as typed (untrimmed: a turn that
// should start on a new line starts with one), are continued over POST /v1/completions.
//
// Rules: one answer streams at a time; the conversation sent is the visible history (answers
// that failed or were stopped before any text are left out); text from the model is only
// ever inserted as text, never as HTML.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STATS_INTERVAL_MS = 1000;
  const KEY_STORAGE = "loom.apiKey";  // sessionStorage: forgotten when the tab closes

  const history = [];       // {role, content} of completed turns
  let controller = null;    // AbortController of the answer streaming now, if any
  let modelName = null;
  let completionMode = false;   // no chat template: continue the text over /v1/completions

  function authHeaders() {
    const key = $("api-key").value.trim();
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = `Bearer ${key}`;
    return headers;
  }

  function setStatus(text, isError = false) {
    const el = $("status");
    el.textContent = text;
    el.classList.toggle("error", isError);
  }

  function addMessage(role, text) {
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    el.textContent = text;
    $("messages").appendChild(el);
    el.scrollIntoView({ block: "end" });
    return el;
  }

  function addMeta(el, text) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = text;
    el.appendChild(meta);
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}`;
  }

  // Splits an SSE byte stream into the JSON payloads of its "data:" lines; "[DONE]" ends it.
  async function* sseEvents(body) {
    const reader = body.getReader();
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
          if (!line.startsWith("data:")) continue;
          const payload = line.slice(5).trim();
          if (payload === "[DONE]") return;
          yield JSON.parse(payload);
        }
      }
    }
  }

  function numberOr(id, fallback) {
    const v = parseFloat($(id).value);
    return Number.isFinite(v) ? v : fallback;
  }

  async function send() {
    // completion mode continues the text as typed: its spaces and newlines are the user's
    const typed = $("prompt").value;
    const text = completionMode ? typed : typed.trim();
    if (!typed.trim() || controller) return;
    $("prompt").value = "";
    addMessage("user", text);
    const turn = { role: "user", content: text };

    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, turn);

    const body = {
      stream: true,
      stream_options: { include_usage: true },
      max_tokens: Math.max(1, Math.round(numberOr("max-tokens", 256))),
      temperature: numberOr("temperature", 0.7),
      top_p: numberOr("top-p", 1),
    };
    if (completionMode) {
      body.prompt = (system ? `${system}\n\n` : "") + [...history, turn].map((m) => m.content).join("");
      body.logprobs = 0;    // one logprob entry per token: exact live token counts
    } else {
      body.messages = messages;
      body.logprobs = true;
      body.top_logprobs = 0;
    }
    if (modelName) body.model = modelName;

    const bubble = addMessage("assistant", "");
    bubble.dataset.state = "streaming";
    const textNode = document.createTextNode("");
    bubble.appendChild(textNode);
    controller = new AbortController();
    $("send").disabled = true;
    $("stop").disabled = false;
    setStatus("generating…");

    const started = performance.now();
    let firstAt = null;
    let tokens = 0;
    let answer = "";
    let finish = null;
    const showRate = () => {
      $("stat-answer-tokens").textContent = String(tokens);
      if (firstAt === null) return;
      const seconds = (performance.now() - firstAt) / 1000;
      if (tokens > 1 && seconds > 0) $("stat-tps").textContent = ((tokens - 1) / seconds).toFixed(1);
    };

    try {
      const endpoint = completionMode ? "/v1/completions" : "/v1/chat/completions";
      const response = await fetch(endpoint, {
        method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw new Error(await errorMessage(response));
      for await (const chunk of sseEvents(response.body)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        for (const choice of chunk.choices || []) {
          const content = completionMode ? choice.text : choice.delta && choice.delta.content;
          const entries = choice.logprobs && (completionMode ? choice.logprobs.tokens : choice.logprobs.content);
          const count = entries ? entries.length : 0;
          if (count > 0 && firstAt === null) {
            firstAt = performance.now();
            $("stat-ttft").textContent = `${((firstAt - started) / 1000).toFixed(2)} s`;
          }
          tokens += count;
          if (content) {
            answer += content;
            textNode.data = answer;
            bubble.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        showRate();
      }
      bubble.dataset.state = "done";
      history.push(turn, { role: "assistant", content: answer });
      const seconds = (performance.now() - started) / 1000;
      addMeta(bubble, `${tokens} tokens in ${seconds.toFixed(1)} s · ${finish || "done"}`);
      setStatus("");
    } catch (err) {
      const stopped = err.name === "AbortError";
      bubble.dataset.state = stopped ? "stopped" : "error";
      if (stopped) {
        if (answer) history.push(turn, { role: "assistant", content: answer });
        addMeta(bubble, "stopped");
        setStatus("stopped");
      } else {
        bubble.classList.add("error");
        textNode.data = answer ? `${answer}\n` : "";
        addMeta(bubble, `error: ${err.message}`);
        setStatus(err.message, true);
      }
    } finally {
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
      showRate();
    }
  }

  async function pollStats() {
    try {
      const response = await fetch("/v1/loom/stats", { headers: authHeaders() });
      if (!response.ok) throw new Error(await errorMessage(response));
      const s = await response.json();
      $("stat-running").textContent = String(s.num_requests_running);
      $("stat-waiting").textContent = String(s.num_requests_waiting);
      $("stat-kv").textContent = `${(100 * s.kv_cache_usage).toFixed(1)} %`;
      $("stat-generated").textContent = String(s.generation_tokens);
      $("stat-prefix").textContent = s.prefix_cache_queries
        ? `${((100 * s.prefix_cache_hits) / s.prefix_cache_queries).toFixed(1)} %` : "–";
      if (!modelName) {
        modelName = s.model;
        $("model-name").textContent = `${s.model} · context ${s.max_model_len} tokens`;
      }
    } catch (err) {
      $("model-name").textContent = `stats unavailable: ${err.message}`;
    } finally {
      setTimeout(pollStats, STATS_INTERVAL_MS);
    }
  }

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    history.length = 0;
    $("messages").replaceChildren();
  });
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    detectMode();
  });

  // A model without a chat template: completion mode (see the top of this file).
  async function detectMode() {
    try {
      const response = await fetch("/tokenizer_info", { headers: authHeaders() });
      if (!response.ok) return;
      const info = await response.json();
      completionMode = info.chat_template === null || info.chat_template === undefined;
      if (completionMode) {
        setStatus("this model has no chat template: the playground continues your text (/v1/completions)");
      }
    } catch (_) { /* keep chat mode */ }
  }

  detectMode();
  pollStats();
})();
