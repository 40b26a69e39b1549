'use strict';
// Against a live gateway (PDD_GATEWAY=host:port; the pytest e2e test starts the stack and runs
// `npm test`). PDD_PROMPT_TOKEN_IDS / PDD_EXPECTED_TOKEN_IDS: the prompt and the tokens the
// Python client received for it (greedy), which the Node client must reproduce exactly.
// PDD_TLS_*: speak TLS (and mTLS) as generate.js does.

const test = require('node:test');
const assert = require('node:assert/strict');
const { execFile } = require('node:child_process');
const path = require('node:path');
const { createClient, generate } = require('../client');

const GATEWAY = process.env.PDD_GATEWAY;
const skip = GATEWAY ? false : 'PDD_GATEWAY is not set (run through the pytest e2e test)';
const ids = (s) => s.split(',').map(Number);
const PROMPT = ids(process.env.PDD_PROMPT_TOKEN_IDS || '5,17,33,2,99,41,8');
const MAX_TOKENS = 10;
const tls = process.env.PDD_TLS_CA ? {
  ca: process.env.PDD_TLS_CA, cert: process.env.PDD_TLS_CERT, key: process.env.PDD_TLS_KEY,
} : undefined;

test('streams a gap-free completion with final stats', { skip }, async () => {
  const client = createClient(GATEWAY, { tls });
  const tokens = [];
  let last;
  try {
    for await (const resp of generate(client, PROMPT, { maxTokens: MAX_TOKENS, ignore_eos: true })) {
      if (resp.token_ids.length) assert.equal(resp.start_position, tokens.length, 'gap or duplicate');
      tokens.push(...resp.token_ids);
      last = resp;
    }
  } finally {
    client.close();
  }
  assert.equal(tokens.length, MAX_TOKENS);
  assert.equal(last.finish_reason, 'FINISH_REASON_LENGTH');
  assert.equal(last.stats.completion_tokens, MAX_TOKENS);
  assert.equal(last.stats.prompt_tokens, PROMPT.length);
  assert.ok(['PIPELINE_P_MD', 'PIPELINE_P_RLD_MD'].includes(last.stats.pipeline));
  if (process.env.PDD_EXPECTED_TOKEN_IDS) assert.deepEqual(tokens, ids(process.env.PDD_EXPECTED_TOKEN_IDS));
});

test('bad input comes back as INVALID_ARGUMENT naming the field', { skip }, async () => {
  const client = createClient(GATEWAY, { tls });
  try {
    await assert.rejects(async () => {
      for await (const _ of generate(client, [1, 2, 999999], { maxTokens: 4 })) { /* drain */ }
    }, (err) => err.code === 3 && /prompt_token_ids\[2\]/.test(err.details));
  } finally {
    client.close();
  }
});

test('generate.js streams JSON lines and exits 0', { skip }, async () => {
  const out = await new Promise((resolve, reject) => {
    execFile(process.execPath, [path.join(__dirname, '..', 'generate.js'), '--address', GATEWAY,
      '--prompt-token-ids', PROMPT.join(','), '--max-tokens', String(MAX_TOKENS), '--ignore-eos', '--json'],
    { env: process.env, timeout: 120000 }, (err, stdout, stderr) => (err ? reject(new Error(`${err}\n${stderr}`))
      : resolve(stdout)));
  });
  const messages = out.trim().split('\n').map((line) => JSON.parse(line));
  const tokens = messages.flatMap((m) => m.token_ids);
  assert.equal(tokens.length, MAX_TOKENS);
  assert.equal(messages.at(-1).stats.completion_tokens, MAX_TOKENS);
  if (process.env.PDD_EXPECTED_TOKEN_IDS) assert.deepEqual(tokens, ids(process.env.PDD_EXPECTED_TOKEN_IDS));
});

test('a bad flag exits 2 with the usage', async () => {
  const code = await new Promise((resolve) => {
    execFile(process.execPath, [path.join(__dirname, '..', 'generate.js'), '--max-tokens', '4'],
      (err) => resolve(err ? err.code : 0));
  });
  assert.equal(code, 2);
});
