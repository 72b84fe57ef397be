// The official OpenAI Node client's view of one base URL, as JSON free of ids and text, for
// scripts/check_clients.py to compare direct with through headroom (make clients).
//
//   node scripts/clients-node/check.mjs BASE_URL API_KEY STREAMS CANARY
//
// Node's own HTTP stack (undici's fetch) is another HTTP/1.1 client than Python's; the calls are
// those of check_clients.py, and STREAMS streams at once of which every other one is aborted by
// the client after three chunks.
import OpenAI from 'openai';

const [base, apiKey, streamsArg, canary] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey, maxRetries: 0, timeout: 60_000 });
const MODEL = 'meta-llama/Llama-3.1-8B-Instruct';
const messages = (extra = '') => [
  { role: 'system', content: 'You answer briefly.' },
  { role: 'user', content: `Say hello. ${canary}${extra}` },
];

// What a stream says: content-bearing chunks, finish reasons, usage.
async function shape(stream, abortAfter, controller) {
  let content = 0;
  const finish = [];
  const usage = [];
  let chunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    for (const choice of chunk.choices) {
      if (choice.delta?.content || choice.text) content += 1;
      if (choice.finish_reason) finish.push(choice.finish_reason);
    }
    if (chunk.usage) usage.push([chunk.usage.prompt_tokens, chunk.usage.completion_tokens]);
    if (abortAfter && chunks === abortAfter) controller.abort();
  }
  return { content, finish, usage };
}

async function error(body) {
  try {
    await client.chat.completions.create(body);
  } catch (e) {
    return [e.constructor.name, e.status, e.message];
  }
  throw new Error(`answered, where an error was due: ${JSON.stringify(body).slice(0, 200)}`);
}

const out = {};
out.models = (await client.models.list()).data.map((m) => m.id);
const whole = await client.chat.completions.create({ model: MODEL, messages: messages(), max_tokens: 12, ignore_eos: true });
out.chat = [whole.choices[0].finish_reason, whole.choices[0].message.role, whole.usage.prompt_tokens, whole.usage.completion_tokens];
for (const asked of [false, true]) {
  const stream = await client.chat.completions.create({
    model: MODEL, messages: messages(), max_tokens: 12, ignore_eos: true, stream: true,
    ...(asked ? { stream_options: { include_usage: true } } : {}),
  });
  out[`chat stream, usage ${asked ? 'asked' : 'not asked'}`] = await shape(stream);
}
const pixel = 'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==';
const vision = await client.chat.completions.create({
  model: MODEL, max_tokens: 12, ignore_eos: true,
  messages: [{ role: 'user', content: [
    { type: 'text', text: `What is in this image? ${canary}` },
    { type: 'image_url', image_url: { url: `data:image/png;base64,${pixel}` } },
  ] }],
});
out['chat with an image'] = [vision.choices[0].finish_reason, vision.usage.prompt_tokens, vision.usage.completion_tokens];
const agent = await client.chat.completions.create({
  model: MODEL, max_tokens: 12, ignore_eos: true,
  tools: [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }],
  messages: [
    ...messages(),
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo"}' } }] },
    { role: 'tool', tool_call_id: 'call_1', content: 'Sunny, 4 degrees' },
  ],
});
out['chat with tools and a tool call'] = [agent.choices[0].finish_reason, agent.usage.prompt_tokens, agent.usage.completion_tokens];
const completion = await client.completions.create({ model: MODEL, prompt: `Once upon a time ${canary}`, max_tokens: 9, ignore_eos: true });
out.completion = [completion.choices[0].finish_reason, completion.usage.prompt_tokens, completion.usage.completion_tokens];
out['completion stream'] = await shape(
  await client.completions.create({ model: MODEL, prompt: `Once upon a time ${canary}`, max_tokens: 9, ignore_eos: true, stream: true }),
);
out['unknown model'] = await error({ model: 'no-such-model', messages: messages(), max_tokens: 3 });
out['max_tokens too large'] = await error({ model: MODEL, messages: messages(), max_tokens: 10 ** 7 });

const streams = Number(streamsArg);
const results = await Promise.all(
  Array.from({ length: streams }, async (_, i) => {
    const aborting = i % 2 === 1;
    const controller = new AbortController();
    const stream = await client.chat.completions.create(
      { model: MODEL, messages: messages(` ${i}`), max_tokens: aborting ? 3000 : 12, ignore_eos: true, stream: true },
      { signal: controller.signal },
    );
    let s;
    try {
      s = await shape(stream, aborting ? 3 : 0, controller);
    } catch (e) {
      // Depending on the version, an abort ends the iteration or throws.
      return aborting && e instanceof OpenAI.APIUserAbortError ? 'aborted' : `failed ${e.constructor.name}: ${e.message}`;
    }
    if (aborting) return s.finish.length === 0 ? 'aborted' : `not aborted ${JSON.stringify(s)}`;
    return s.finish.join() === 'length' && s.content === 12 ? 'complete' : `incomplete ${JSON.stringify(s)}`;
  }),
);
out.concurrent = results.reduce((tally, r) => ({ ...tally, [r]: (tally[r] ?? 0) + 1 }), {});
console.log(JSON.stringify(out));
