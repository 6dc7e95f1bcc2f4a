// A client of stagecast.v1 in another language: it knows the API only from proto/stagecast/v1/stream.proto,
// loaded at run time (enums by name), as a Node.js application would. tests/test_gateway_edge.py runs it:
//
//   node tests/node/foreign_client.mjs HOST:PORT     -> one JSON line: what the stream and a bad request gave
import { fileURLToPath } from "node:url";
import path from "node:path";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "proto");
const definition = protoLoader.loadSync("stagecast/v1/stream.proto", {
  includeDirs: [root],
  keepCase: true, // field names as in the .proto (target_fps)
  enums: String, // enum fields as their names, e.g. "CODEC_RAW"
  longs: Number,
  defaults: false,
  oneofs: true,
});
const v1 = grpc.loadPackageDefinition(definition).stagecast.v1;
const client = new v1.StreamService(process.argv[2], grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 120_000);

function generate(config) {
  return new Promise((resolve) => {
    const replies = [];
    const call = client.Generate({ deadline: deadline() });
    call.on("data", (msg) => replies.push(msg));
    call.on("error", (err) => resolve({ replies, code: err.code, details: err.details }));
    call.on("end", () => resolve({ replies, code: 0, details: "" }));
    call.write({ config });
    call.end();
  });
}

const ok = await generate({ prompt: "a red fox running through snow", width: 32, height: 32, seconds: 0.25, codec: "CODEC_RAW" });
const started = ok.replies.find((m) => m.msg === "started")?.started;
const frames = ok.replies.filter((m) => m.msg === "frame").map((m) => m.frame);
const end = ok.replies.find((m) => m.msg === "end")?.end;
const bad = await generate({ prompt: "a red fox", codec: 99 });
const status = await new Promise((resolve, reject) =>
  client.GetStatus({}, { deadline: deadline() }, (err, reply) => (err ? reject(err) : resolve(reply))),
);
console.log(
  JSON.stringify({
    code: ok.code,
    details: ok.details,
    config: started?.config,
    totalFrames: started?.total_frames,
    frames: frames.length,
    frameCodecs: [...new Set(frames.map((f) => f.codec))],
    frameBytes: [...new Set(frames.map((f) => f.data.length))],
    endReason: end?.reason,
    endFrames: end?.frames,
    badCode: bad.code,
    badDetails: bad.details,
    statusMaxStreams: status.max_streams,
  }),
);
client.close();
