// lmserve web chat: a client of this server's OpenAI API (relative URLs, so a route prefix works).
//
// What it sends is what the user set: sampling fields left at the model's defaults (reported by
// GET v1/models as `generation_defaults`) are not sent, so the server's configured values apply.
// Answers are markdown, rendered by marked and sanitized by DOMPurify before they reach the DOM.
// Stop aborts the fetch: the connection closes and the server stops generating that answer.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "lmserve-api-key";
  const SETTINGS_STORE = "lmserve-webchat-settings";
  const NARROW = window.matchMedia("(max-width: 760px)");

  // request field -> input id, parser and how to show a default
  const SAMPLING = {
    temperature: { id: "temperature", parse: Number.parseFloat },
    top_p: { id: "top-p", parse: Number.parseFloat },
    top_k: { id: "top-k", parse: (v) => Number.parseInt(v, 10) },
    max_tokens: { id: "max-tokens", parse: (v) => Number.parseInt(v, 10) },
    repetition_penalty: { id: "repetition-penalty", parse: Number.parseFloat },
  };

  const TOOLS_EXAMPLE = [{
    type: "function",
    function: {
      name: "get_weather",
      description: "The current weather in a city.",
      parameters: {
        type: "object",
        properties: { city: { type: "string", description: "City name, e.g. Paris" } },
        required: ["city"],
      },
    },
  }];

  const state = {
    models: new Map(), // model ID -> its /v1/models card
    turns: [], // {role: "user", text, images} | {role: "assistant", model, text, toolCalls, status, ...} | {role: "tool", ...}
    overrides: {}, // sampling field -> value the user set
    controller: null, // AbortController of the answer streaming now
    images: [], // data URLs to send with the next user message
    editing: null, // index of the user turn being edited
    skipToolReply: false, // the user chose to answer a tool call with a user message
    keyRequired: null, // null: not known yet
    renderQueued: new Set(),
  };

  // ---- settings kept in this browser -------------------------------------------------------

  function loadSettings() {
    try {
      const saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
      $("system").value = saved.system || "";
      $("tools").value = saved.tools || "";
      for (const [field, value] of Object.entries(saved.overrides || {})) {
        if (field in SAMPLING && typeof value === "number" && Number.isFinite(value)) state.overrides[field] = value;
      }
    } catch (err) {
      localStorage.removeItem(SETTINGS_STORE);
    }
  }

  function saveSettings() {
    const settings = { system: $("system").value, tools: $("tools").value, overrides: state.overrides };
    localStorage.setItem(SETTINGS_STORE, JSON.stringify(settings));
  }

  function apiKey() {
    return localStorage.getItem(KEY_STORE) || "";
  }

  function headers() {
    const h = { "content-type": "application/json" };
    if (apiKey()) h.authorization = "Bearer " + apiKey();
    return h;
  }

  // ---- notices, the key prompt --------------------------------------------------------------

  function notice(text, kind = "info", action = null) {
    $("notice").className = kind;
    $("notice-text").textContent = text;
    const button = $("notice-action");
    button.hidden = !action;
    if (action) {
      button.textContent = action.label;
      button.onclick = () => { clearNotice(); action.run(); };
    }
    $("notice").hidden = false;
  }

  function clearNotice() {
    $("notice").hidden = true;
  }

  function showKeyPrompt(refusal) {
    state.keyRequired = true;
    const error = $("key-error");
    error.hidden = !apiKey();
    error.textContent = apiKey() ? `The server refused the key kept in this browser (${refusal}). Check it and paste it again.` : "";
    $("key-prompt").hidden = false;
    $("key-input").value = "";
    $("key-input").focus();
    updateKeyStatus();
    updateComposer();
  }

  function updateKeyStatus() {
    const status = $("key-status");
    if (state.keyRequired === null) return;
    if (!state.keyRequired) status.textContent = "This server needs no API key.";
    else if (!$("key-prompt").hidden) status.textContent = "This server needs an API key: enter it in the box above the chat.";
    else status.textContent = "Your API key is kept in this browser and sent with each request.";
    $("forget-key").hidden = !apiKey();
  }

  async function apiError(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (err) { /* not JSON: keep the status line */ }
    const error = new Error(message);
    error.status = response.status;
    return error;
  }

  // ---- models and their defaults --------------------------------------------------------------

  async function loadModels() {
    let response;
    try {
      response = await fetch("v1/models", { headers: headers() });
    } catch (err) {
      notice(`Could not reach the server (${err.message}).`, "error", { label: "Retry", run: loadModels });
      return;
    }
    if (response.status === 401) {
      showKeyPrompt((await apiError(response)).message);
      return;
    }
    if (!response.ok) {
      notice(`Could not list the models: ${(await apiError(response)).message}`, "error",
        { label: "Retry", run: loadModels });
      return;
    }
    // with a key kept here, whether the server needs it is not asked (a request without it
    // would count as a failed one in the server's metrics)
    state.keyRequired = apiKey() ? true : false;
    $("key-prompt").hidden = true;
    clearNotice();
    const cards = (await response.json()).data || [];
    const select = $("model");
    const previous = select.value;
    select.replaceChildren();
    state.models.clear();
    for (const card of cards) {
      state.models.set(card.id, card);
      const option = document.createElement("option");
      option.value = card.id;
      option.textContent = card.id + (takesImages(card) ? " \u00b7 images" : "");
      select.appendChild(option);
    }
    // A configured model (no parent) answers as LLaMA-Factory's web chat does, adapters applied;
    // `<id>:<adapter>` and `<id>:base` (parent set) are its adapters alone and its base model.
    const configured = cards.find((card) => !card.parent);
    if (state.models.has(previous)) select.value = previous;
    else if (configured) select.value = configured.id;
    if (!cards.length) notice("The server lists no models.", "error");
    updateKeyStatus();
    showDefaults();
    updateComposer();
    renderLog();
  }

  function currentCard() {
    return state.models.get($("model").value) || null;
  }

  function takesImages(card) {
    return Boolean(card && (card.input_modalities || []).includes("image"));
  }

  function showDefaults() {
    const card = currentCard();
    const defaults = (card && card.generation_defaults) || null;
    for (const [field, spec] of Object.entries(SAMPLING)) {
      const row = document.querySelector(`.field[data-field="${field}"]`);
      const input = $(spec.id);
      const custom = field in state.overrides;
      const fallback = defaults ? defaults[field] : undefined;
      row.classList.toggle("custom", custom);
      input.classList.remove("invalid");
      if (custom) input.value = String(state.overrides[field]);
      else input.value = fallback === undefined ? "" : String(fallback);
      let origin = "model default";
      if (custom) origin = fallback === undefined ? "yours" : `yours (model default ${fallback})`;
      else if (fallback === undefined) origin = "server default";
      else if (field === "temperature" && fallback === 0) origin = "model default (greedy)";
      else if (field === "max_tokens") origin = "model default (less if the context is shorter)";
      row.querySelector(".origin").textContent = origin;
      row.querySelector(".reset").hidden = !custom;
    }
    const note = $("sampling-note");
    if (!card) note.textContent = "";
    else if (!defaults) {
      note.textContent = `The server reports no defaults for ${card.id}; fields you leave alone take the ones it is configured with.`;
    } else {
      note.textContent = `These start from ${card.id}'s configured defaults (its YAML's temperature, top_p, top_k, ` +
        "max_new_tokens, repetition_penalty). Only the values you change are sent; the server fills in the rest.";
    }
  }

  function onSamplingInput(field) {
    const spec = SAMPLING[field];
    const input = $(spec.id);
    const raw = input.value.trim();
    if (raw === "") {
      delete state.overrides[field];
      input.classList.remove("invalid");
    } else {
      const value = spec.parse(raw);
      input.classList.toggle("invalid", !Number.isFinite(value));
      if (Number.isFinite(value)) state.overrides[field] = value;
    }
    const row = input.closest(".field");
    const custom = field in state.overrides;
    row.classList.toggle("custom", custom);
    row.querySelector(".reset").hidden = !custom;
    const defaults = (currentCard() || {}).generation_defaults;
    const fallback = defaults ? defaults[field] : undefined;
    row.querySelector(".origin").textContent = custom
      ? (fallback === undefined ? "yours" : `yours (model default ${fallback})`)
      : (fallback === undefined ? "server default" : "model default");
    saveSettings();
  }

  // ---- tools ----------------------------------------------------------------------------------

  // The tools array to send, null for none; throws with a message for text that is not one.
  function toolsValue() {
    const text = $("tools").value.trim();
    if (!text) return null;
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (err) {
      throw new Error(`not valid JSON (${err.message})`);
    }
    if (!Array.isArray(tools)) throw new Error("must be a JSON array of tools");
    tools.forEach((tool, i) => {
      if (!tool || typeof tool !== "object" || !tool.function || typeof tool.function.name !== "string") {
        throw new Error(`tool ${i} needs function.name`);
      }
    });
    return tools.length ? tools : null;
  }

  function checkTools() {
    const status = $("tools-status");
    try {
      const tools = toolsValue();
      status.textContent = tools ? `${tools.length} tool${tools.length > 1 ? "s" : ""}: ` +
        tools.map((t) => t.function.name).join(", ") : "No tools.";
      status.className = "muted";
      $("tools").classList.remove("invalid");
      return true;
    } catch (err) {
      status.textContent = "Tools " + err.message + ".";
      status.className = "error-text";
      $("tools").classList.add("invalid");
      return false;
    }
  }

  // ---- images -----------------------------------------------------------------------------------

  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  function noImagesMessage() {
    const card = currentCard();
    const name = card ? card.id : "This model";
    return `${name} does not accept images: the server lists it as text-only (it is not a vision-language ` +
      "model, or its backend takes no images). Pick a model marked \u201cimages\u201d to send pictures.";
  }

  async function addImages(files) {
    if (!takesImages(currentCard())) {
      notice(noImagesMessage(), "error");
      return;
    }
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        notice(`${file.name} is not an image.`, "error");
        continue;
      }
      state.images.push(await readDataUrl(file));
    }
    renderAttachments();
  }

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    state.images.forEach((url, i) => {
      const thumb = el("div", "thumb");
      const img = el("img");
      img.src = url;
      img.alt = `image ${i + 1} to send`;
      const remove = el("button", "", "\u00d7");
      remove.type = "button";
      remove.title = "Remove this image";
      remove.onclick = () => { state.images.splice(i, 1); renderAttachments(); };
      thumb.append(img, remove);
      box.appendChild(thumb);
    });
  }

  // ---- markdown ---------------------------------------------------------------------------------

  const PURIFY = {
    USE_PROFILE: { html: true },
    // no element of an answer may load anything (the page's CSP forbids it too), restyle the page
    // or take an id or name that the page's own elements use
    FORBID_TAGS: ["style", "img", "video", "audio", "source", "picture", "form", "input", "button", "select",
      "textarea", "iframe", "object", "embed", "link", "meta", "base"],
    FORBID_ATTR: ["style", "id", "name"],
    RETURN_DOM_FRAGMENT: true,
  };
  let purifyReady = false;

  function setUpPurify() {
    if (purifyReady || !window.DOMPurify) return;
    window.DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
      // marked's `language-xyz` on code is the only class an answer keeps
      if (data.attrName === "class") data.keepAttr = node.nodeName === "CODE" && /^language-[\w+#.-]+$/.test(data.attrValue);
    });
    window.DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.nodeName === "A") {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer");
      }
    });
    purifyReady = true;
  }

  function markdown(text) {
    if (!window.marked || !window.DOMPurify) {
      const pre = el("div", "", text); // the libraries did not load: plain text, never HTML
      pre.style.whiteSpace = "pre-wrap";
      const fragment = document.createDocumentFragment();
      fragment.appendChild(pre);
      return fragment;
    }
    setUpPurify();
    return window.DOMPurify.sanitize(window.marked.parse(text, { gfm: true, breaks: true }), PURIFY);
  }

  // `<think>...</think>` at the start of an answer (reasoning templates served with
  // `reasoning_split: false`; otherwise the thought arrives in `reasoning_content`) -> [thought, answer]
  function splitThought(text) {
    const match = /^\s*<think>([\s\S]*?)(?:<\/think>|$)([\s\S]*)$/.exec(text);
    return match ? [match[1].trim(), match[2]] : [null, text];
  }

  function renderMarkdown(body, text, reasoning = "") {
    const [thought, answer] = reasoning ? [reasoning.trim(), text] : splitThought(text);
    const parts = [];
    if (thought !== null) {
      const details = el("details", "thought");
      const summary = el("summary", "", "Thoughts");
      details.append(summary, markdown(thought));
      parts.push(details);
    }
    parts.push(markdown(answer));
    body.replaceChildren(...parts);
    decorateCode(body);
  }

  function decorateCode(root) {
    for (const code of root.querySelectorAll("pre > code")) {
      const language = (/language-([\w+#.-]+)/.exec(code.className) || [])[1];
      if (language && window.hljs && !window.hljs.getLanguage(language)) code.classList.remove(`language-${language}`);
      if (window.hljs) window.hljs.highlightElement(code);
      const copy = el("button", "copy-code", "Copy");
      copy.type = "button";
      copy.title = "Copy this code";
      copy.onclick = () => copyText(code.textContent, copy);
      code.parentElement.appendChild(copy);
    }
  }

  // ---- the conversation -------------------------------------------------------------------------

  function el(tag, className = "", text = null) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== null) node.textContent = text;
    return node;
  }

  function button(label, title, onclick, className = "") {
    const b = el("button", className, label);
    b.type = "button";
    b.title = title;
    b.onclick = onclick;
    return b;
  }

  async function copyText(text, source) {
    try {
      await navigator.clipboard.writeText(text);
    } catch (err) {
      // navigator.clipboard is missing on plain http from another host: the old way
      const area = el("textarea");
      area.value = text;
      document.body.appendChild(area);
      area.select();
      document.execCommand("copy");
      area.remove();
    }
    const label = source.textContent;
    source.textContent = "Copied";
    setTimeout(() => { source.textContent = label; }, 1200);
  }

  function lastIndex(role) {
    for (let i = state.turns.length - 1; i >= 0; i--) if (state.turns[i].role === role) return i;
    return -1;
  }

  function statusLine(turn) {
    const parts = [];
    if (turn.status === "stopped") parts.push("stopped");
    if (turn.finish === "length") parts.push("cut at max tokens");
    if (turn.usage) parts.push(`${turn.usage.completion_tokens} tokens`);
    if (turn.seconds !== undefined) parts.push(`${turn.seconds.toFixed(1)} s`);
    return parts.join(" \u00b7 ");
  }

  function turnText(turn) {
    if (turn.role !== "assistant" || turn.text || !turn.toolCalls.length) return turn.text;
    return JSON.stringify(turn.toolCalls.map((c) => ({ name: c.name, arguments: parseArguments(c.arguments) })), null, 2);
  }

  function parseArguments(text) {
    try { return JSON.parse(text); } catch (err) { return text; }
  }

  function renderToolCalls(container, turn) {
    for (const call of turn.toolCalls) {
      const box = el("div", "tool-call");
      const args = parseArguments(call.arguments);
      box.append(el("div", "name", `Tool call \u00b7 ${call.name || "(unnamed)"}`));
      const pre = el("pre");
      const code = el("code", "language-json", typeof args === "string" ? args : JSON.stringify(args, null, 2));
      pre.appendChild(code);
      box.appendChild(pre);
      container.appendChild(box);
      if (window.hljs) window.hljs.highlightElement(code);
    }
  }

  function renderTurn(turn, index) {
    const busy = Boolean(state.controller);
    const node = el("article", `msg ${turn.role}`);
    node.dataset.index = String(index);
    const meta = el("div", "meta");
    const body = el("div", "body");
    const actions = el("div", "actions");
    if (turn.role === "user") {
      meta.appendChild(el("span", "who", "You"));
      if (state.editing === index) {
        const edit = el("div", "edit");
        const area = el("textarea");
        area.value = turn.text;
        area.setAttribute("aria-label", "Edit your message");
        edit.append(area, el("div", "actions"));
        edit.lastChild.append(
          button("Send", "Send the edited message (the answers after it are dropped)", () => {
            if (toolsOrNotice() === undefined) return;
            turn.text = area.value;
            state.turns.length = index + 1;
            state.editing = null;
            generate();
          }),
          button("Cancel", "Keep the message as it was", () => { state.editing = null; renderLog(); }));
        node.append(meta, edit);
        area.addEventListener("keydown", (e) => {
          if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); edit.lastChild.firstChild.click(); }
        });
        setTimeout(() => area.focus(), 0);
        return node;
      }
      body.textContent = turn.text;
      if (turn.images.length) {
        const images = el("div", "images");
        for (const url of turn.images) {
          const img = el("img");
          img.src = url;
          img.alt = "an image you sent";
          images.appendChild(img);
        }
        body.appendChild(images);
      }
      actions.appendChild(button("Copy", "Copy this message", (e) => copyText(turn.text, e.target)));
      if (index === lastIndex("user") && !busy) {
        actions.appendChild(button("Edit", "Edit this message and send it again", () => {
          state.editing = index;
          renderLog();
        }, "edit-button"));
      }
      if (index === state.turns.length - 1 && !busy) { // nothing answered it (the tools were not valid)
        actions.appendChild(button("Answer", "Ask the model to answer this message", regenerate, "regenerate"));
      }
    } else if (turn.role === "tool") {
      meta.appendChild(el("span", "who", `Tool result \u00b7 ${turn.name}`));
      body.textContent = turn.text;
      actions.appendChild(button("Copy", "Copy this result", (e) => copyText(turn.text, e.target)));
    } else {
      node.dataset.state = turn.status;
      meta.append(el("span", "who", turn.model), el("span", "status", statusLine(turn)));
      renderAssistantBody(body, turn);
      if (turn.status !== "streaming") {
        actions.appendChild(button("Copy", "Copy this answer (markdown)", (e) => copyText(turnText(turn), e.target)));
        if (index === state.turns.length - 1 && !busy) {
          actions.appendChild(button("Regenerate", "Ask again for this answer, with the current model and settings",
            regenerate, "regenerate"));
        }
      }
    }
    node.append(meta, body, actions);
    turn.node = node;
    return node;
  }

  function renderAssistantBody(body, turn) {
    if (turn.text || turn.thought) renderMarkdown(body, turn.text, turn.thought);
    else body.replaceChildren();
    renderToolCalls(body, turn);
    if (turn.status === "error") body.appendChild(el("div", "error-box", "Error: " + turn.error));
    if (!turn.text && !turn.toolCalls.length && turn.status === "done") body.appendChild(el("span", "muted", "(empty answer)"));
  }

  function renderLog() {
    const log = $("log");
    const nearBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
    log.replaceChildren();
    if (!state.turns.length) {
      const card = currentCard();
      const empty = el("div", "empty");
      empty.appendChild(el("p", "", card ? `Ask ${card.id} anything.` : ""));
      empty.appendChild(el("p", "", "Answers are rendered as markdown. Enter sends, Shift+Enter adds a line, Esc stops " +
        "an answer; sampling, tools and the system prompt are in the settings (\u2630)."));
      log.appendChild(empty);
    }
    state.turns.forEach((turn, i) => log.appendChild(renderTurn(turn, i)));
    if (nearBottom) log.scrollTop = log.scrollHeight;
    updateComposer();
  }

  // Re-render a streaming answer at most once a frame.
  function queueRender(turn) {
    if (state.renderQueued.has(turn)) return;
    state.renderQueued.add(turn);
    requestAnimationFrame(() => {
      state.renderQueued.delete(turn);
      if (!turn.node || !turn.node.isConnected) return;
      const log = $("log");
      const nearBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
      renderAssistantBody(turn.node.querySelector(".body"), turn);
      if (nearBottom) log.scrollTop = log.scrollHeight;
    });
  }

  // The tool call the next message answers: the first call of the last answer without a result.
  function pendingToolCall() {
    if (state.skipToolReply) return null;
    let i = state.turns.length - 1;
    const answered = new Set();
    while (i >= 0 && state.turns[i].role === "tool") answered.add(state.turns[i--].callId);
    const turn = state.turns[i];
    if (!turn || turn.role !== "assistant" || turn.status !== "done") return null;
    return turn.toolCalls.find((call) => !answered.has(call.id)) || null;
  }

  function updateComposer() {
    const busy = Boolean(state.controller);
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("send").disabled = !state.models.size;
    const call = pendingToolCall();
    $("tool-reply").hidden = !call || busy;
    if (call) {
      $("tool-reply-text").textContent = `Your next message is the result of ${call.name}(${call.arguments}), ` +
        "sent as a tool message; ";
    }
    $("prompt").placeholder = call ? `Result of ${call.name}` : "Message";
    $("attach").setAttribute("aria-disabled", String(!takesImages(currentCard())));
    $("attach").title = takesImages(currentCard()) ? "Attach images" : noImagesMessage();
  }

  // ---- talking to the server ----------------------------------------------------------------------

  function requestMessages() {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    for (const turn of state.turns) {
      if (turn.role === "user") {
        if (!turn.images.length) {
          messages.push({ role: "user", content: turn.text });
        } else {
          const parts = turn.text ? [{ type: "text", text: turn.text }] : [];
          for (const url of turn.images) parts.push({ type: "image_url", image_url: { url } });
          messages.push({ role: "user", content: parts });
        }
      } else if (turn.role === "tool") {
        messages.push({ role: "tool", tool_call_id: turn.callId, content: turn.text });
      } else if (turn.text || turn.toolCalls.length) { // an answer that failed before any text is left out
        const message = { role: "assistant", content: turn.text || (turn.toolCalls.length ? null : "") };
        if (turn.toolCalls.length) {
          message.tool_calls = turn.toolCalls.map((call) => (
            { id: call.id, type: "function", function: { name: call.name, arguments: call.arguments } }));
        }
        messages.push(message);
      }
    }
    return messages;
  }

  function requestBody(model, tools) {
    const body = { model, messages: requestMessages(), stream: true, stream_options: { include_usage: true } };
    for (const [field, value] of Object.entries(state.overrides)) body[field] = value;
    if (tools) body.tools = tools;
    return body;
  }

  async function readEvents(response, onChunk) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          onChunk(chunk);
        }
      }
    }
  }

  function applyChunk(turn, chunk) {
    if (chunk.usage) turn.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      const thought = delta.reasoning_content ?? delta.reasoning; // sent back in no later request
      if (thought) turn.thought = (turn.thought || "") + thought;
      if (delta.content) turn.text += delta.content;
      for (const piece of delta.tool_calls || []) {
        const at = piece.index ?? turn.toolCalls.length;
        const call = turn.toolCalls[at] || (turn.toolCalls[at] = { id: "", name: "", arguments: "" });
        if (piece.id) call.id = piece.id;
        if (piece.function && piece.function.name) call.name = piece.function.name;
        if (piece.function && piece.function.arguments) call.arguments += piece.function.arguments;
      }
      if (choice.finish_reason) turn.finish = choice.finish_reason;
    }
  }

  // The tools to send (null for none), or undefined after telling the user why they cannot be.
  function toolsOrNotice() {
    try {
      return toolsValue();
    } catch (err) {
      notice(`The tools in the settings are ${err.message}: fix them or clear the box.`, "error");
      return undefined;
    }
  }

  // Ask the model for the next answer to the conversation as it stands.
  async function generate() {
    const tools = toolsOrNotice();
    if (tools === undefined) {
      renderLog();
      return;
    }
    const model = $("model").value;
    const body = requestBody(model, tools);
    const turn = { role: "assistant", model, text: "", toolCalls: [], status: "streaming", finish: null, usage: null };
    state.turns.push(turn);
    state.skipToolReply = false;
    const controller = new AbortController();
    state.controller = controller;
    clearNotice();
    renderLog();
    $("log").scrollTop = $("log").scrollHeight;
    const started = performance.now();
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) {
        const error = await apiError(response);
        if (error.status === 401) showKeyPrompt(error.message);
        throw error;
      }
      await readEvents(response, (chunk) => { applyChunk(turn, chunk); queueRender(turn); });
      turn.status = "done";
    } catch (err) {
      if (controller.signal.aborted) {
        turn.status = "stopped";
      } else {
        turn.status = "error";
        turn.error = err.message;
      }
    } finally {
      turn.seconds = (performance.now() - started) / 1000;
      state.controller = null;
      renderLog();
      $("prompt").focus();
    }
  }

  function stop() {
    if (state.controller) state.controller.abort();
  }

  function regenerate() {
    if (state.controller || toolsOrNotice() === undefined) return;
    const last = state.turns[state.turns.length - 1];
    if (last && last.role === "assistant") state.turns.pop();
    generate();
  }

  function submit() {
    if (state.controller || toolsOrNotice() === undefined) return;
    const text = $("prompt").value;
    const call = pendingToolCall();
    if (call) {
      if (!text.trim()) return;
      const name = call.name;
      state.turns.push({ role: "tool", callId: call.id, name, text });
      $("prompt").value = "";
      autosize();
      if (pendingToolCall()) renderLog(); // more calls of that answer wait for their result
      else generate();
      return;
    }
    if (!text.trim() && !state.images.length) return;
    if (!state.models.size) {
      notice("There is no model to ask yet.", "error");
      return;
    }
    if (state.images.length && !takesImages(currentCard())) {
      notice(noImagesMessage() + " Remove the images to send the text.", "error");
      return;
    }
    state.turns.push({ role: "user", text, images: state.images });
    state.images = [];
    renderAttachments();
    $("prompt").value = "";
    autosize();
    generate();
  }

  function newChat() {
    stop();
    state.turns = [];
    state.images = [];
    state.editing = null;
    state.skipToolReply = false;
    renderAttachments();
    clearNotice();
    renderLog();
    $("prompt").focus();
  }

  function autosize() {
    const prompt = $("prompt");
    prompt.style.height = "auto";
    prompt.style.height = Math.min(prompt.scrollHeight + 2, 200) + "px";
  }

  function toggleSettings(open) {
    const toggled = document.body.classList.toggle("settings-toggled", open);
    const shown = NARROW.matches ? toggled : !toggled;
    $("toggle-settings").setAttribute("aria-expanded", String(shown));
    $("scrim").hidden = !(NARROW.matches && shown);
  }

  // ---- wiring -----------------------------------------------------------------------------------

  function start() {
    loadSettings();
    checkTools();
    for (const [field, spec] of Object.entries(SAMPLING)) {
      $(spec.id).addEventListener("input", () => onSamplingInput(field));
      document.querySelector(`.field[data-field="${field}"] .reset`).addEventListener("click", () => {
        delete state.overrides[field];
        saveSettings();
        showDefaults();
      });
    }
    $("system").addEventListener("input", saveSettings);
    $("tools").addEventListener("input", () => { checkTools(); saveSettings(); });
    $("tools-example").addEventListener("click", () => {
      $("tools").value = JSON.stringify(TOOLS_EXAMPLE, null, 2);
      checkTools();
      saveSettings();
    });
    $("model").addEventListener("change", () => {
      showDefaults();
      updateComposer();
      if (state.images.length && !takesImages(currentCard())) notice(noImagesMessage(), "error");
      if (!state.turns.length) renderLog();
    });
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      localStorage.setItem(KEY_STORE, key);
      state.keyRequired = true;
      loadModels();
    });
    $("forget-key").addEventListener("click", () => {
      localStorage.removeItem(KEY_STORE);
      state.keyRequired = null;
      loadModels();
    });
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); submit(); });
    $("prompt").addEventListener("keydown", (e) => {
      // isComposing: Enter that ends an IME composition (Chinese, Japanese, ...) does not send
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
        e.preventDefault();
        submit();
      }
    });
    $("prompt").addEventListener("input", autosize);
    $("prompt").addEventListener("paste", (e) => {
      const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
      if (files.length) { e.preventDefault(); addImages(files); }
    });
    $("composer").addEventListener("dragover", (e) => e.preventDefault());
    $("composer").addEventListener("drop", (e) => {
      e.preventDefault();
      if (e.dataTransfer && e.dataTransfer.files.length) addImages([...e.dataTransfer.files]);
    });
    $("stop").addEventListener("click", stop);
    $("attach").addEventListener("click", () => {
      if (!takesImages(currentCard())) notice(noImagesMessage(), "error");
      else $("file").click();
    });
    $("file").addEventListener("change", () => { addImages([...$("file").files]); $("file").value = ""; });
    $("new-chat").addEventListener("click", newChat);
    $("notice-close").addEventListener("click", clearNotice);
    $("tool-reply-skip").addEventListener("click", () => { state.skipToolReply = true; updateComposer(); });
    $("toggle-settings").addEventListener("click", () => toggleSettings());
    $("scrim").addEventListener("click", () => toggleSettings(false));
    $("close-settings").addEventListener("click", () => toggleSettings(false));
    NARROW.addEventListener("change", () => toggleSettings(false));
    document.addEventListener("keydown", (e) => {
      if (e.key !== "Escape") return;
      if (state.controller) { e.preventDefault(); stop(); } else if (NARROW.matches) toggleSettings(false);
    });
    toggleSettings(false);
    renderLog();
    loadModels();
    $("prompt").focus();
  }

  start();
})();
