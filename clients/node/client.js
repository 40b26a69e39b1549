'use strict';
// The PDD gateway from Node.js: protos/ loaded at run time (@grpc/proto-loader), one channel
// (@grpc/grpc-js), Generate as an async iterable of GenerateResponse objects.
//
// A request's life from here: generateRequest() builds the GenerateRequest (text or token ids,
// sampling, routing overrides) -> GatewayService/Generate streams token deltas, each with its
// start_position and stage -> the last message carries finish_reason and stats. Field names stay
// snake_case as in the .proto; enums arrive as their names; uint64 as strings.

const fs = require('node:fs');
const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTOS = path.resolve(__dirname, '..', '..', 'protos');

function loadGateway(protosDir = process.env.PDD_PROTOS || DEFAULT_PROTOS) {
  const definition = protoLoader.loadSync('pdd/gateway/v1/gateway_service.proto', {
    includeDirs: [protosDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).pdd.gateway.v1;
}

// tls: undefined (plaintext) or {ca, cert, key, serverName} with file paths; cert + key = mTLS.
function credentials(tls) {
  if (!tls) return { creds: grpc.credentials.createInsecure(), options: {} };
  if (Boolean(tls.cert) !== Boolean(tls.key)) throw new Error('tls: cert and key go together');
  const read = (p) => (p ? fs.readFileSync(p) : null);
  const creds = grpc.credentials.createSsl(read(tls.ca), read(tls.key), read(tls.cert));
  const options = tls.serverName ? { 'grpc.ssl_target_name_override': tls.serverName } : {};
  return { creds, options };
}

function createClient(address, { tls, protosDir } = {}) {
  const { GatewayService } = loadGateway(protosDir);
  const { creds, options } = credentials(tls);
  return new GatewayService(address, creds, options);
}

// prompt: a string or an array of token ids; fields: any other GenerateRequest field.
function generateRequest(prompt, { maxTokens = 64, temperature = 0, seed, ...fields } = {}) {
  const request = { max_tokens: maxTokens, temperature, ...fields };
  if (typeof prompt === 'string') request.prompt = prompt;
  else request.prompt_token_ids = { token_ids: prompt };
  if (seed !== undefined && seed !== null) request.seed = seed;
  return request;
}

// An async iterable of GenerateResponse objects; rejects with a grpc error (err.code, err.details).
function generate(client, prompt, { timeoutMs = 120000, ...fields } = {}) {
  const deadline = new Date(Date.now() + timeoutMs);
  return client.Generate(generateRequest(prompt, fields), { deadline });
}

module.exports = { createClient, credentials, generate, generateRequest, loadGateway, DEFAULT_PROTOS };
