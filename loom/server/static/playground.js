// loom playground: chat over POST /v1/chat/completions with "stream": true, read as
// server-sent events from fetch()'s ReadableStream; server load polled from GET /v1/loom/stats.
// A model without a chat template (GET /tokenizer_info says null: a base model) gets completion
// mode instead: the system text and the turns so far, joined as typed (untrimmed: a turn that
// should start on a new line starts with one), are continued over POST /v1/completions.
//
// Rules: one answer streams at a time; the conversation sent is the visible history (answers
// that failed or were stopped before any text are left out); text from the model is only
// ever inserted as text, never as HTML. The conversation and the settings are kept in the
// browser's localStorage (per server address) and shown again after a reload; Clear forgets the
// conversation (the settings stay).
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STATS_INTERVAL_MS = 1000;
  const KEY_STORAGE = "loom.apiKey";  // sessionStorage: forgotten when the tab closes
  const CHAT_STORAGE = "loom.chat";   // localStorage: the conversation and settings, kept across reloads
  const SETTINGS = ["system", "max-tokens", "temperature", "top-p"];

  const history = [];       // {role, content} of completed turns
  let conversation = 0;     // bumped by Clear: an answer of an earlier conversation adds nothing to this one
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

  // Follows new text only where the reader is at the end already (one who scrolled up to
  // re-read stays where they are).
  function atEnd() {
    const page = document.scrollingElement || document.documentElement;
    return page.scrollHeight - page.scrollTop - page.clientHeight < 80;
  }

  function addMessage(role, text) {
    const follow = atEnd();
    const el = document.createElement("div");
    el.className = `msg ${role}`;
    el.textContent = text;
    $("messages").appendChild(el);
    if (follow) el.scrollIntoView({ block: "end" });
    return el;
  }

  function save() {
    try {
      const settings = Object.fromEntries(SETTINGS.map((id) => [id, $(id).value]));
      localStorage.setItem(CHAT_STORAGE, JSON.stringify({ history, settings }));
    } catch (_) { /* storage full or turned off: the page works without it */ }
  }

  // The saved conversation and settings, shown as they were; anything not in their shape is
  // dropped (storage other code or an older page wrote).
  function restore() {
    let saved = null;
    try { saved = JSON.parse(localStorage.getItem(CHAT_STORAGE) || "null"); } catch (_) { /* unreadable */ }
    if (!saved || typeof saved !== "object") return;
    const settings = saved.settings || {};
    for (const id of SETTINGS) if (typeof settings[id] === "string") $(id).value = settings[id];
    const turns = Array.isArray(saved.history) ? saved.history : [];
    for (let i = 0; i + 1 < turns.length; i += 2) {   // user and assistant turns in pairs
      const [asked, answered] = [turns[i], turns[i + 1]];
      if (!asked || !answered || asked.role !== "user" || answered.role !== "assistant"
          || typeof asked.content !== "string" || typeof answered.content !== "string") break;
      history.push({ role: "user", content: asked.content }, { role: "assistant", content: answered.content });
      addMessage("user", asked.content);
      addMessage("assistant", answered.content).dataset.state = "done";
    }
  }

  function addMeta(el, text) {
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = text;
    el.appendChild(meta);
  }

  async function errorMessage(response) {
    if (response.status === 401) {
      return $("api-key").value.trim() ? "the API key is not this server's: correct it in the API key field"
        : "this server needs its API key (--api-key): enter it in the API key field";
    }
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return body.error.message;
    } catch (_) { /* not JSON */ }
    return `HTTP ${response.status} ${response.statusText}`;
  }

  // Splits an SSE byte stream into the JSON payloads of its "data:" lines; "[DONE]" ends it
  // (a stream that closes before it was cut off: an error). Lines may end in \r\n, \n or \r,
  // as the event-stream format allows (a proxy may rewrite them).
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error("the answer's stream ended before it was complete");
      buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n?/g, "\n");
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

  // A settings field's number: its default when empty; anything else that is not a number in
  // the field's min/max range is refused with a message naming it (never replaced silently).
  function setting(id, fallback, integer = false) {
    const field = $(id);
    const raw = field.value.trim();
    if (raw === "" && !field.validity.badInput) return fallback;
    const v = Number(raw);
    const min = field.min === "" ? -Infinity : Number(field.min);
    const max = field.max === "" ? Infinity : Number(field.max);
    if (field.validity.badInput || !Number.isFinite(v) || v < min || v > max || (integer && !Number.isInteger(v))) {
      const range = `${Number.isFinite(min) ? min : "…"} to ${Number.isFinite(max) ? max : "…"}`;
      throw new Error(`${field.labels[0] ? field.labels[0].textContent.trim() : id}: give ${integer ? "a whole number" : "a number"} from ${range} (got "${raw}")`);
    }
    return v;
  }

  async function send() {
    // completion mode continues the text as typed: its spaces and newlines are the user's
    const typed = $("prompt").value;
    const text = completionMode ? typed : typed.trim();
    if (!typed.trim() || controller) return;
    let body;
    try {
      body = {
        stream: true,
        stream_options: { include_usage: true },
        max_tokens: setting("max-tokens", 256, true),
        temperature: setting("temperature", 0.7),
        top_p: setting("top-p", 1),
      };
    } catch (err) {   // the message stays in the box, to send once the setting is fixed
      setStatus(err.message, true);
      return;
    }
    $("prompt").value = "";
    const asked = addMessage("user", text);
    const turn = { role: "user", content: text };
    const mine = conversation;

    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, turn);

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

    for (const id of ["stat-ttft", "stat-tps"]) $(id).textContent = "–";
    $("stat-answer-tokens").textContent = "0";
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
      const post = () => fetch(endpoint, {
        method: "POST", headers: authHeaders(), body: JSON.stringify(body), signal: controller.signal,
      });
      let response = await post();
      if (!response.ok) {
        const message = await errorMessage(response);
        // near the context's end the server refuses max tokens past the room left (as vLLM's):
        // ask once more for what fits, and say so
        const room = /maximum context length is (\d+) tokens and your request has (\d+) input tokens/.exec(message);
        const left = room ? Number(room[1]) - Number(room[2]) : 0;
        if (response.status !== 400 || left < 1 || left >= body.max_tokens) throw new Error(message);
        body.max_tokens = left;
        addMeta(asked, `max tokens cut to ${left}: the room left in the context`);
        response = await post();
        if (!response.ok) throw new Error(await errorMessage(response));
      }
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
            const follow = atEnd();
            answer += content;
            textNode.data = answer;
            if (follow) bubble.scrollIntoView({ block: "end" });
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        showRate();
      }
      bubble.dataset.state = "done";
      if (mine === conversation) {
        history.push(turn, { role: "assistant", content: answer });
        save();
      }
      const seconds = (performance.now() - started) / 1000;
      addMeta(bubble, `${tokens} ${tokens === 1 ? "token" : "tokens"} in ${seconds.toFixed(1)} s · ${finish || "done"}`);
      setStatus("");
    } catch (err) {
      const stopped = err.name === "AbortError";
      bubble.dataset.state = stopped ? "stopped" : "error";
      if (stopped) {
        if (answer && mine === conversation) {
          history.push(turn, { role: "assistant", content: answer });
          save();
        }
        addMeta(bubble, "stopped");
        if (mine === conversation) setStatus("stopped");
      } else {
        bubble.classList.add("error");
        textNode.data = answer ? `${answer}\n` : "";
        addMeta(bubble, `error: ${err.message}`);
        if (!answer) {   // nothing answered: the message is not part of the conversation; it is offered again
          asked.classList.add("unsent");
          addMeta(asked, "not sent: the answer failed");
          if (!$("prompt").value) $("prompt").value = typed;
        }
        setStatus(err.message, true);
      }
    } finally {
      controller = null;
      $("send").disabled = false;
      $("stop").disabled = true;
      showRate();
    }
  }

  let statsFailed = false;
  let statsTimer = null;
  let keyMissing = false;   // a 401: poll seldom until the key changes (not a refused request a second)
  async function pollStats() {
    try {
      const response = await fetch("/v1/loom/stats", { headers: authHeaders() });
      keyMissing = response.status === 401;
      if (!response.ok) throw new Error(await errorMessage(response));
      const s = await response.json();
      $("stat-running").textContent = String(s.num_requests_running);
      $("stat-waiting").textContent = String(s.num_requests_waiting);
      $("stat-kv").textContent = `${(100 * s.kv_cache_usage).toFixed(1)} %`;
      $("stat-generated").textContent = String(s.generation_tokens);
      $("stat-prefix").textContent = s.prefix_cache_queries
        ? `${((100 * s.prefix_cache_hits) / s.prefix_cache_queries).toFixed(1)} %` : "–";
      // written on every answer: the header recovers after an error, and a server that came back
      // with another model (or the same one) is followed, its chat or completion mode checked again
      $("model-name").textContent = `${s.model} · context ${s.max_model_len} tokens`;
      if (modelName !== s.model || statsFailed) {
        modelName = s.model;
        detectMode();
      }
      statsFailed = false;
    } catch (err) {
      statsFailed = true;
      $("model-name").textContent = `stats unavailable: ${err.message}`;
    } finally {
      statsTimer = setTimeout(pollStats, keyMissing ? 10 * STATS_INTERVAL_MS : STATS_INTERVAL_MS);
    }
  }

  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.isComposing || e.keyCode === 229) return;   // Enter confirming an input method's candidate
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("clear").addEventListener("click", () => {
    conversation += 1;   // the answer being stopped belongs to the conversation cleared
    if (controller) controller.abort();
    history.length = 0;
    save();
    $("messages").replaceChildren();
    for (const id of ["stat-ttft", "stat-tps"]) $(id).textContent = "–";
    $("stat-answer-tokens").textContent = "0";
    setStatus("");
  });
  for (const id of SETTINGS) $(id).addEventListener("change", save);
  restore();
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    detectMode();
    clearTimeout(statsTimer);
    pollStats();
  });

  // A model without a chat template: completion mode (see the top of this file).
  async function detectMode() {
    try {
      const response = await fetch("/tokenizer_info", { headers: authHeaders() });
      if (!response.ok) return;
      const info = await response.json();
      const was = completionMode;
      completionMode = info.chat_template === null || info.chat_template === undefined;
      if (completionMode && !was) {
        setStatus("this model has no chat template: the playground continues your text (/v1/completions)");
      } else if (was && !completionMode) {
        setStatus("this model has a chat template: the playground chats (/v1/chat/completions)");
      }
    } catch (_) { /* keep chat mode */ }
  }

  detectMode();
  pollStats();
})();
