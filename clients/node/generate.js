#!/usr/bin/env node
'use strict';
// pdd-generate: stream one completion from a PDD gateway.
// Prints the text as it arrives, or with --json one JSON object per response message.
// Exit 1 on a gRPC error (its status name on stderr), 2 on bad arguments.

const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const { createClient, generate } = require('./client');

const USAGE = `usage: generate.js [--address HOST:PORT] (--prompt TEXT | --prompt-token-ids 1,2,3)
  [--max-tokens N] [--temperature T] [--seed N] [--ignore-eos] [--json] [--timeout-s S]
  [--tls-ca PEM] [--tls-cert PEM --tls-key PEM] [--tls-server-name NAME]
env: PDD_GATEWAY (address), PDD_TLS_CA, PDD_TLS_CERT, PDD_TLS_KEY, PDD_TLS_SERVER_NAME, PDD_PROTOS`;

function parse(argv) {
  const env = process.env;
  const { values } = parseArgs({
    args: argv,
    options: {
      address: { type: 'string', default: env.PDD_GATEWAY || 'localhost:50050' },
      prompt: { type: 'string' },
      'prompt-token-ids': { type: 'string' },
      'max-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string', default: '0' },
      seed: { type: 'string' },
      'ignore-eos': { type: 'boolean', default: false },
      json: { type: 'boolean', default: false },
      'timeout-s': { type: 'string', default: '120' },
      'tls-ca': { type: 'string', default: env.PDD_TLS_CA || '' },
      'tls-cert': { type: 'string', default: env.PDD_TLS_CERT || '' },
      'tls-key': { type: 'string', default: env.PDD_TLS_KEY || '' },
      'tls-server-name': { type: 'string', default: env.PDD_TLS_SERVER_NAME || '' },
      help: { type: 'boolean', default: false },
    },
  });
  if (values.help) return { help: true };
  if ((values.prompt === undefined) === (values['prompt-token-ids'] === undefined)) {
    throw new Error('give exactly one of --prompt and --prompt-token-ids');
  }
  const int = (name) => {
    const n = Number(values[name]);
    if (!Number.isInteger(n) || n < 0) throw new Error(`--${name}: expected a non-negative integer`);
    return n;
  };
  const prompt = values.prompt !== undefined ? values.prompt
    : values['prompt-token-ids'].split(',').map((t) => {
      const n = Number(t);
      if (!Number.isInteger(n) || n < 0) throw new Error(`--prompt-token-ids: bad token id ${JSON.stringify(t)}`);
      return n;
    });
  const tls = values['tls-ca'] || values['tls-cert'] ? {
    ca: values['tls-ca'], cert: values['tls-cert'], key: values['tls-key'], serverName: values['tls-server-name'],
  } : undefined;
  return {
    address: values.address,
    prompt,
    tls,
    json: values.json,
    fields: {
      maxTokens: int('max-tokens'),
      temperature: Number(values.temperature),
      seed: values.seed !== undefined ? int('seed') : undefined,
      ignore_eos: values['ignore-eos'],
      timeoutMs: Number(values['timeout-s']) * 1000,
    },
  };
}

async function main(argv) {
  let args;
  try {
    args = parse(argv);
  } catch (err) {
    process.stderr.write(`${err.message}\n${USAGE}\n`);
    return 2;
  }
  if (args.help) {
    process.stdout.write(`${USAGE}\n`);
    return 0;
  }
  const client = createClient(args.address, { tls: args.tls });
  try {
    for await (const resp of generate(client, args.prompt, args.fields)) {
      if (args.json) process.stdout.write(`${JSON.stringify(resp)}\n`);
      else if (resp.text) process.stdout.write(resp.text);
    }
    if (!args.json) process.stdout.write('\n');
    return 0;
  } catch (err) {
    const name = Object.keys(grpc.status).find((k) => grpc.status[k] === err.code) || 'UNKNOWN';
    process.stderr.write(`${name}: ${err.details || err.message}\n`);
    return 1;
  } finally {
    client.close();
  }
}

if (require.main === module) {
  main(process.argv.slice(2)).then((code) => { process.exitCode = code; });
}

module.exports = { main, parse };
