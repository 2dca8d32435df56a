#!/usr/bin/env node
// Calls polar.v1.InferenceService/Generate from Node.js and prints the whole stream as one JSON
// object: the proof that the contract needs nothing but the .proto files (loaded at run time here).
//
// Usage: node generate_client.js HOST:PORT '{"prompt_token_ids": [1, 2], "sampling": {"max_tokens": 8}}'
// Prints {"token_ids": [...], "logprobs": [...], "messages": N, "policy_versions": [...],
//         "finish_reason": "FINISH_REASON_STOP", "usage": {...}, "queue_seconds": S};
// on an error status prints {"code": ..., "details": ...} to stderr and exits 1.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.join(__dirname, "..", "..", "protos");

function main() {
  const [address, requestJson] = process.argv.slice(2);
  if (!address || !requestJson) {
    process.stderr.write("usage: node generate_client.js HOST:PORT REQUEST_JSON\n");
    process.exit(2);
  }
  const definition = protoLoader.loadSync("polar/v1/inference.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
  });
  const polar = grpc.loadPackageDefinition(definition).polar.v1;
  const client = new polar.InferenceService(address, grpc.credentials.createInsecure());

  const result = { token_ids: [], logprobs: [], messages: 0, policy_versions: [] };
  const call = client.Generate(JSON.parse(requestJson));
  call.on("data", (message) => {
    result.messages += 1;
    result.token_ids.push(...message.token_ids);
    result.logprobs.push(...message.logprobs);
    result.policy_versions.push(message.policy_version);
    if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
      result.finish_reason = message.finish_reason;
      result.usage = message.usage;
      result.queue_seconds = message.queue_seconds;
    }
  });
  // A clean stream is complete when both "end" (every message read) and "status" have come, in
  // either order; a failed one when "status" has. Without an "error" listener a failure throws.
  let ended = false;
  let status = null;
  const finish = () => {
    if (status === null || (status.code === grpc.status.OK && !ended)) return;
    if (status.code === grpc.status.OK) {
      process.stdout.write(JSON.stringify(result) + "\n");
    } else {
      process.stderr.write(JSON.stringify({ code: grpc.status[status.code], details: status.details }) + "\n");
      process.exitCode = 1;
    }
    status = null;
    client.close();
  };
  call.on("end", () => {
    ended = true;
    finish();
  });
  call.on("status", (received) => {
    status = received;
    finish();
  });
  call.on("error", () => {});
}

main();
