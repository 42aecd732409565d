// The Vercel AI SDK's own chat client (AbstractChat + DefaultChatTransport from the `ai`
// package, no React) against torpor's /v1/ai-sdk/chat. Prints one JSON object a line:
// {"event": ...} when the test must act (cut the network, let the model go on), and
// {"case": ...} with what the SDK assembled. Run by tests/test_serve_ai_sdk.py:
//   node chat.mjs DIRECT_URL PROXIED_URL TOKEN
import {
  AbstractChat,
  DefaultChatTransport,
  lastAssistantMessageIsCompleteWithApprovalResponses,
} from "ai";

const [direct, proxied, token] = process.argv.slice(2);
const FIRST = "The first half of a long answer, ";
const out = (o) => process.stdout.write(JSON.stringify(o) + "\n");

// The chat's state as a UI framework would keep it (React's useChat keeps the same).
class State {
  constructor() {
    this.status = "ready";
    this.error = undefined;
    this.messages = [];
    this.listeners = [];
  }
  pushMessage(m) { this.messages = [...this.messages, structuredClone(m)]; this.changed(); }
  popMessage() { this.messages = this.messages.slice(0, -1); this.changed(); }
  replaceMessage(i, m) {
    this.messages = [...this.messages.slice(0, i), structuredClone(m), ...this.messages.slice(i + 1)];
    this.changed();
  }
  snapshot(x) { return structuredClone(x); }
  changed() { for (const listener of this.listeners) listener(this.messages); }
}

class Chat extends AbstractChat {}

// A fetch that records each response's status, protocol header and chunks (a tee of the body).
function recording(log, onResumeOpen) {
  return async (url, init) => {
    const response = await fetch(url, init);
    const entry = {
      method: init?.method ?? "GET", path: new URL(url).pathname, status: response.status,
      protocol: response.headers.get("x-vercel-ai-ui-message-stream"), chunks: [],
    };
    log.push(entry);
    if (entry.method === "GET" && onResumeOpen) onResumeOpen(entry);
    if (!response.body) return response;
    const [mine, theirs] = response.body.tee();
    (async () => {
      const decoder = new TextDecoder();
      let text = "";
      try {
        for await (const piece of theirs) text += decoder.decode(piece, { stream: true });
      } catch { entry.cut = true; }
      for (const line of text.split(/\r?\n/)) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        entry.chunks.push(data === "[DONE]" ? "[DONE]" : JSON.parse(data).type);
      }
    })();
    return new Response(mine, { status: response.status, headers: response.headers });
  };
}

function transport(base, log, onResumeOpen) {
  return new DefaultChatTransport({
    api: `${base}/v1/ai-sdk/chat`,
    headers: { Authorization: `Bearer ${token}` },
    fetch: recording(log, onResumeOpen),
  });
}

function summary(messages) {
  return messages.map((m) => ({
    id: m.id,
    role: m.role,
    parts: m.parts.map((p) => {
      if (p.type === "text") return { type: p.type, text: p.text, state: p.state };
      if (p.type.startsWith("tool-") || p.type === "dynamic-tool") {
        const { type, state, toolCallId, input, output, errorText, approval } = p;
        return { type, state, toolCallId, input, output, errorText, approval };
      }
      if (p.type.startsWith("data-")) return { type: p.type, data: p.data };
      return { type: p.type };
    }),
  }));
}

const textOf = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");
const tick = () => new Promise((resolve) => setImmediate(resolve));

async function simple(id, text) {
  const log = [];
  const chat = new Chat({ id, state: new State(), transport: transport(direct, log) });
  await chat.sendMessage({ text });
  await tick();
  return { status: chat.status, error: chat.error?.message ?? null,
           messages: summary(chat.messages), requests: log };
}

async function approval(id, text, approved, reason) {
  const log = [];
  let finished = null;
  const chat = new Chat({
    id, state: new State(), transport: transport(direct, log),
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithApprovalResponses,
    onFinish: () => finished?.(),
  });
  await chat.sendMessage({ text });
  const asked = summary(chat.messages);
  const part = chat.lastMessage.parts.find((p) => p.state === "approval-requested");
  const continued = new Promise((resolve) => { finished = resolve; });
  await chat.addToolApprovalResponse({ id: part.approval.id, approved, reason });
  await continued; // the SDK sent the answer by itself (sendAutomaticallyWhen)
  await tick();
  return { status: chat.status, error: chat.error?.message ?? null, asked,
           messages: summary(chat.messages), requests: log };
}

async function resume() {
  const log = [];
  const state = new State();
  const chat = new Chat({
    id: "ai-resume", state,
    transport: transport(proxied, log, (entry) => out({ event: "resume-open", status: entry.status })),
  });
  let told = false;
  state.listeners.push((messages) => {
    const last = messages.at(-1);
    if (!told && last?.role === "assistant" && textOf(last).startsWith(FIRST)) {
      told = true;
      out({ event: "first-half" }); // the test cuts the connection now
    }
  });
  await chat.sendMessage({ text: "a long answer, please" }); // returns when the network drops
  const cut = { status: chat.status, error: chat.error?.message ?? null,
                messages: summary(chat.messages) };
  await chat.resumeStream(); // GET /v1/ai-sdk/chat/ai-resume/stream: the answer replayed
  await tick();
  return { cut, status: chat.status, error: chat.error?.message ?? null,
           messages: summary(chat.messages), requests: log };
}

async function main() {
  out({ case: "answer", ...(await simple("ai-answer", "hello")) });
  const none = await transport(direct, []).reconnectToStream({ chatId: "ai-answer" });
  out({ case: "nothing-to-resume", stream: none });
  out({ case: "tool", ...(await simple("ai-tool", "weather in Paris?")) });
  out({ case: "approved", ...(await approval("ai-approve", "deploy it", true)) });
  out({ case: "denied", ...(await approval("ai-deny", "delete it", false, "not today")) });
  out({ case: "resume", ...(await resume()) });
  out({ case: "error", ...(await simple("ai-error", "fail, please")) });
}

main().then(
  () => process.exit(0),
  (error) => { out({ case: "crash", error: String(error?.stack ?? error) }); process.exit(1); },
);
