// The Vercel AI SDK (ai + @ai-sdk/openai, @ai-sdk/anthropic, @ai-sdk/openai-compatible,
// pinned in package.json) against a running mlxd, driven by tests/integration/test_ai_sdk.py.
// Each check runs through the SDK's own functions, whose zod schemas validate every
// response and stream part they read, and prints one JSON line: {name, ok, ...what it
// saw} or {name, ok: false, error}. The config comes as JSON in argv[2]:
// {url, tools: model, think: model, vision: model, embed: model, image: base64 PNG}.
import { embedMany, generateObject, generateText, stepCountIs, streamObject, streamText, tool }
  from 'ai';
import { createAnthropic } from '@ai-sdk/anthropic';
import { createOpenAI } from '@ai-sdk/openai';
import { createOpenAICompatible } from '@ai-sdk/openai-compatible';
import { z } from 'zod';

const cfg = JSON.parse(process.argv[2]);
// Greedy everywhere, so that every check is deterministic: the SDK leaves `temperature`
// out of a reasoning request (the hosted reasoning models refuse it), and the harness
// puts 0 back into any generation body without one. Nothing the SDK reads is touched.
const sent = [];  // every generation body, as the SDK wrote it
async function greedy(url, init) {
  if (typeof init?.body === 'string' && !String(url).endsWith('/embeddings')) {
    const body = JSON.parse(init.body);
    sent.push(body);
    if (body.temperature === undefined) init = { ...init, body: JSON.stringify({ ...body, temperature: 0 }) };
  }
  return fetch(url, init);
}
const base = { baseURL: cfg.url + '/v1', apiKey: 'unused', fetch: greedy };
const openai = createOpenAI(base);
const anthropic = createAnthropic(base);
const compat = createOpenAICompatible({ ...base, name: 'mlxd', includeUsage: true,
                                        supportsStructuredOutputs: true });
// The API each provider speaks, by name.
const providers = {
  responses: (m) => openai.responses(m),
  chat: (m) => openai.chat(m),
  messages: (m) => anthropic(m),
  compatible: (m) => compat.chatModel(m),
};
const weather = tool({
  description: 'The weather in a city for some days',
  inputSchema: z.object({ city: z.enum(['Paris', 'Rome']), days: z.number().int().min(1).max(7) }),
  execute: async ({ city, days }) => ({ city, days, temp: 21 }),
});
const record = z.object({ city: z.enum(['Paris', 'Rome']), ok: z.boolean() });
const atZero = { temperature: 0 };

async function streamed(result) {
  const parts = [];
  for await (const part of result.fullStream) {
    if (part.type === 'error') throw part.error;
    parts.push(part.type);
  }
  return [...new Set(parts)];
}

const checks = {};
for (const [api, make] of Object.entries(providers)) {
  const model = make(cfg.tools);
  checks[`${api} text`] = async () => {
    const r = await generateText({ model, prompt: 'Say hi', maxOutputTokens: 8, ...atZero });
    return { text: r.text, finish: r.finishReason, usage: r.usage };
  };
  checks[`${api} stream`] = async () => {
    const r = streamText({ model, prompt: 'Say hi', maxOutputTokens: 8, ...atZero });
    const parts = await streamed(r);
    return { text: await r.text, finish: await r.finishReason, usage: await r.usage, parts };
  };
  checks[`${api} tools`] = async () => {
    const r = await generateText({ model, prompt: 'Weather in Paris for 3 days?', tools: { weather },
                                   toolChoice: 'required', maxOutputTokens: 200,
                                   stopWhen: stepCountIs(2), ...atZero });
    return { steps: r.steps.length, calls: r.steps[0].toolCalls.map((c) => c.input),
             results: r.steps[0].toolResults.map((t) => t.output), finish: r.finishReason };
  };
  checks[`${api} stream tools`] = async () => {
    const r = streamText({ model, prompt: 'Weather in Paris for 3 days?', tools: { weather },
                           toolChoice: 'required', maxOutputTokens: 200,
                           stopWhen: stepCountIs(2), ...atZero });
    const parts = await streamed(r);
    const steps = await r.steps;
    return { steps: steps.length, calls: steps[0].toolCalls.map((c) => c.input), parts };
  };
  checks[`${api} object`] = async () => {
    const r = await generateObject({ model, schema: record, prompt: 'A city', maxOutputTokens: 200,
                                     ...atZero });
    return { object: r.object, finish: r.finishReason };
  };
  checks[`${api} stream object`] = async () => {
    const r = streamObject({ model, schema: record, prompt: 'A city', maxOutputTokens: 200, ...atZero });
    let partials = 0;
    for await (const _ of r.partialObjectStream) partials += 1;
    return { object: await r.object, partials };
  };
  checks[`${api} image`] = async () => {
    const r = await generateText({
      model: make(cfg.vision), maxOutputTokens: 4, ...atZero,
      messages: [{ role: 'user', content: [
        { type: 'text', text: 'What is this?' },
        { type: 'image', image: Buffer.from(cfg.image, 'base64'), mediaType: 'image/png' }] }] });
    const bare = await generateText({ model: make(cfg.vision), prompt: 'What is this?',
                                      maxOutputTokens: 4, ...atZero });
    return { text: r.text, finish: r.finishReason, usage: r.usage, without: bare.usage };
  };
}
// Reasoning: the Responses API's summary (the only reasoning this SDK reads there, asked
// for with reasoningSummary on a model it does not know as a reasoning one), Anthropic's
// thinking blocks, chat completions' reasoning_content (the openai-compatible package).
const think = { openai: { forceReasoning: true, reasoningEffort: 'high', reasoningSummary: 'auto' },
                anthropic: { thinking: { type: 'enabled', budgetTokens: 16 } } };
checks['responses reasoning'] = async () => {
  const r = await generateText({ model: openai.responses(cfg.think), prompt: 'Think',
                                 maxOutputTokens: 12, providerOptions: think });
  return { reasoning: r.reasoningText, id: r.providerMetadata?.openai?.responseId,
           usage: r.usage };
};
checks['responses stream reasoning'] = async () => {
  const r = streamText({ model: openai.responses(cfg.think), prompt: 'Think', maxOutputTokens: 12,
                         providerOptions: think });
  const parts = await streamed(r);
  return { reasoning: await r.reasoningText, parts };
};
// Stateless (`store: false`): the SDK asks for reasoning.encrypted_content and, in the
// conversation's next request, sends back only the reasoning items that carry it.
checks['responses stateless reasoning'] = async () => {
  const from = sent.length;
  const options = { openai: { ...think.openai, store: false } };
  const first = await generateText({ model: openai.responses(cfg.think), prompt: 'Think',
                                     maxOutputTokens: 12, providerOptions: options });
  await generateText({
    model: openai.responses(cfg.think), maxOutputTokens: 4, providerOptions: options,
    messages: [{ role: 'user', content: 'Think' }, ...first.response.messages,
               { role: 'user', content: 'And then?' }] });
  const bodies = sent.slice(from);
  return { reasoning: first.reasoningText, include: bodies[0].include ?? [],
           sentBack: bodies[1].input.filter((i) => i.type === 'reasoning')
             .map((i) => i.encrypted_content ?? null) };
};
checks['messages reasoning'] = async () => {
  const r = await generateText({ model: anthropic(cfg.think), prompt: 'Think', maxOutputTokens: 12,
                                 providerOptions: think });
  return { reasoning: r.reasoningText };
};
checks['compatible reasoning'] = async () => {
  const r = await generateText({ model: compat.chatModel(cfg.think), prompt: 'Think',
                                 maxOutputTokens: 12 });
  return { reasoning: r.reasoningText };
};
checks['embeddings'] = async () => {
  const r = await embedMany({ model: openai.embedding(cfg.embed), values: ['sunny', 'rainy'] });
  const one = await embedMany({ model: compat.textEmbeddingModel(cfg.embed), values: ['sunny'] });
  const short = await embedMany({ model: openai.embedding(cfg.embed), values: ['sunny'],
                                  providerOptions: { openai: { dimensions: 16 } } });
  return { embeddings: r.embeddings, usage: r.usage, compatible: one.embeddings[0],
           dimensions: short.embeddings[0].length };
};

const only = process.argv[3];
for (const [name, run] of Object.entries(checks)) {
  if (only && !name.includes(only)) continue;
  try {
    console.log(JSON.stringify({ name, ok: true, ...(await run()) }));
  } catch (e) {
    console.log(JSON.stringify({ name, ok: false, error: String(e?.message ?? e),
                                 body: e?.responseBody ?? null }));
  }
}
