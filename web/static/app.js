// stagecast live page: WebRTC (video track + "control" data channel) or the WebSocket fallback (fMP4 into MSE).
// Control messages are the same on both: config, prompt, stop, ping; the server answers started, frame (stats),
// prompt_updated, end, error.  WebRTC that does not connect within 5 s, or a browser without it, falls back to the
// WebSocket by itself; an error shows in the status line in plain words, resets the stats and leaves the page idle.
// The size list offers only what the gateway's cost budget admits (api/budget), its default included.  Lateness is
// judged on a playout clock that starts once a buffer's worth of frames has come.  Record saves the pictures the
// video element shows on the stream's own clock, stalls left out (MediaRecorder: MP4 where the browser makes it, else
// WebM), optionally the webcam too, with a sidecar JSON of the prompt switches, their times and what was left out.
// window.stagecast exposes the page's state (tests read it).
"use strict";

const $ = (id) => document.getElementById(id);
const state = (window.stagecast = {
  transport: null, started: null, frames: 0, firstFrameMs: null, promptUpdates: [], ends: [], errors: [],
  events: [], framesReceived: 0, running: false, fallbacks: 0, budget: null, recordings: [], recording: null,
  lastPts: null, lastLateMs: null,
});
let info = { token_required: false, ice_servers: [] };
let budget = null; // the gateway's cost budget (api/budget): which sizes it admits
let allSizes = []; // the size list as the page ships it: [{value, text}]
// WebRTC that has not connected by then gives way to the WebSocket (UDP blocked, no TURN): the user waits 5 s, not 15.
const ICE_TIMEOUT_MS = 5000;
let conn = null; // {send(obj), close()}
let t0 = 0;
const perSecond = []; // [{fps, ontime}] one point a second, for the sparkline
let windowFrames = [];

function log(kind, text) {
  state.events.push({ kind, text });
  const li = document.createElement("li");
  li.textContent = `${kind}: ${text}`;
  if (kind === "error") li.className = "error";
  $("events").prepend(li);
  while ($("events").children.length > 200) $("events").lastChild.remove();
}

function setStatus(text, kind) { $("status").textContent = text; $("status").className = kind || ""; }

function authHeaders() { return token() ? { Authorization: `Bearer ${token()}` } : {}; }

// A failure ends the attempt: the status line says what (red) and the page is idle again, so Start retries.
function fail(text, record) {
  state.errors.push(record || { message: text }); log("error", text);
  state.running = false;
  resetStats(); // the failed stream's numbers are not the next one's
  setStatus(`idle: ${text} (press Start to retry)`, "error");
  $("update").disabled = true; $("stop").disabled = true;
}

// gRPC's own words for a connection lost under a stream ("Stream removed (Socket closed)") tell a viewer nothing:
// say what happened, and keep gRPC's text in the event log.  The gateway's own refusals name their field: as they are.
const LOST_CODES = ["UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL"];
const TRANSPORT_TEXT = new RegExp("stream removed|socket closed|connection reset|connection refused|failed to connect|" +
  "broken pipe|goaway|rst_stream|connections to all backends failing|end of tcp stream|keepalive", "i");

function explain(code, message) {
  if (LOST_CODES.includes(code) && TRANSPORT_TEXT.test(message || "")) {
    return `the connection to the gateway was lost (${code}): it may be restarting or overloaded`;
  }
  return `${code}: ${message}`;
}

// The stats show the stream running now (or the last one that ended): none after a failure or before a start.
function resetStats() {
  state.started = null; state.frames = 0; state.firstFrameMs = null;
  windowFrames = []; perSecond.length = 0; playout = null;
  for (const id of ["ttff", "fps", "ontime"]) $(id).textContent = "–";
  $("frames").textContent = "0";
  $("late-reason").textContent = ""; $("late-reason").hidden = true;
}

// ---- sizes: only what the gateway's cost budget admits -------------------------------------------------------

function admits(w, h) {
  const steps = parseInt($("steps").value, 10) || budget.default_steps;
  const passes = steps + (budget.default_passes - budget.default_steps);
  const fps = Math.max(budget.default_fps, budget.min_fps);
  return w * h <= budget.max_frame_pixels && w * h * fps * passes <= budget.max_stream_cost;
}

// The server's default is offered only where the budget admits it too (a default it would refuse is no choice).
function offerSizes() {
  if (!budget || !budget.max_frame_pixels) return; // unknown: offer the whole list
  const select = $("size"); const chosen = select.value;
  select.replaceChildren();
  for (const { value, text } of allSizes) {
    const [w, h] = value ? value.split("x").map(Number) : [budget.default_width, budget.default_height];
    if (!admits(w, h)) continue;
    const opt = document.createElement("option"); opt.value = value;
    opt.textContent = value ? text : `default (${w}×${h})`;
    select.append(opt);
  }
  if (!select.options.length) { // none at these steps: the server's refusal will say why
    const opt = document.createElement("option"); opt.value = "";
    opt.textContent = "none fits the server's budget at these steps (fewer steps)"; select.append(opt);
  }
  const options = [...select.options];
  select.value = options.some((o) => o.value === chosen) ? chosen : options[0].value;
}

async function loadBudget() {
  try {
    const resp = await fetch("api/budget", { headers: authHeaders() });
    const body = await resp.json();
    if (!resp.ok) { log("budget", body.error || resp.statusText); return; }
    budget = body; state.budget = body; offerSizes();
  } catch (err) { log("budget", err.message); }
}

function token() {
  const fromHash = new URLSearchParams(location.hash.slice(1)).get("token");
  return fromHash || $("token").value.trim() || null;
}

function config() {
  const cfg = { type: "config", prompt: $("prompt").value };
  const steps = $("steps").value; if (steps) cfg.steps = parseInt(steps, 10);
  const size = $("size").value;
  if (size) { const [w, h] = size.split("x").map(Number); cfg.width = w; cfg.height = h; }
  const seed = $("seed").value; if (seed) cfg.seed = parseInt(seed, 10);
  const seconds = $("seconds").value; if (seconds && Number(seconds) > 0) cfg.seconds = Number(seconds);
  const guidance = $("guidance").value; if (guidance) cfg.guidance_scale = Number(guidance);
  const decoder = $("decoder").value; if (decoder) cfg.decoder = decoder;
  if ($("negative").value && guidance && Number(guidance) > 1) cfg.negative_prompt = $("negative").value;
  if ($("webcam").checked) {  // video-to-video: the input is the clock, so no seconds
    delete cfg.seconds;
    if ($("strength").value) cfg.strength = Number($("strength").value);
  }
  return cfg;
}

function onMessage(msg) {
  switch (msg.type) {
    case "started":
      state.started = msg; state.running = true; state.frames = 0; state.firstFrameMs = null; windowFrames = [];
      state.lastPts = null; playout = newPlayout(msg.config.target_fps || 16);
      setStatus(`streaming (${state.transport}) ${msg.config.width}×${msg.config.height} @ ` +
        `${msg.config.target_fps} fps, ${msg.config.steps} steps`);
      log("started", `stream ${msg.stream_id}, seed ${msg.config.seed}`);
      $("update").disabled = false; $("stop").disabled = false;
      break;
    case "frame": {
      const now = performance.now();
      recordFrame(msg);
      if (state.firstFrameMs === null) {
        state.firstFrameMs = now - t0;
        $("ttff").textContent = `${(state.firstFrameMs / 1000).toFixed(2)} s`;
      }
      state.frames += 1; state.framesReceived += 1;
      const waited = playout ? playoutFrame(playout, msg.pts, now) : null;
      windowFrames.push({ at: now, late: msg.late_ms, held: (msg.sent_s - msg.received_s) * 1000, waited });
      $("frames").textContent = state.frames;
      break;
    }
    case "prompt_updated":
      state.promptUpdates.push(msg.prompt); log("prompt_updated", msg.prompt); recordSwitch(msg.prompt); break;
    case "end":
      state.running = false; state.ends.push(msg); log("end", `${msg.reason} after ${msg.frames} frames`);
      recordEnd();
      setStatus(`ended: ${msg.reason}`);
      $("update").disabled = true; $("stop").disabled = true;
      break;
    case "error": { // the server's refusal or the stream's failure: it is over
      const text = explain(msg.code, msg.message);
      if (text !== `${msg.code}: ${msg.message}`) log("grpc", `${msg.code}: ${msg.message}`);
      fail(text, msg); recordEnd(); break;
    }
    case "init":
      if (conn && conn.init) conn.init(msg.mime);
      break;
  }
}

// ---- WebRTC -------------------------------------------------------------------------------------------------

let camera = null; // the webcam's MediaStream while the toggle is on

async function startWebRTC() {
  const pc = new RTCPeerConnection({ iceServers: info.ice_servers || [] });
  if ($("webcam").checked) {
    camera = camera || await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 }, audio: false });
    $("camera").srcObject = camera; $("camera").hidden = false;
    camera.getVideoTracks().forEach((t) => pc.addTrack(t, camera)); // sendrecv: the webcam out, the result back
  } else {
    pc.addTransceiver("video", { direction: "recvonly" });
  }
  const dc = pc.createDataChannel("control");
  let ping = null;
  pc.ontrack = (e) => { $("video").srcObject = e.streams[0] || new MediaStream([e.track]); };
  let connectFailed = null; let connected = false;
  const notConnected = new Promise((resolve) => { connectFailed = resolve; });
  pc.onconnectionstatechange = () => {
    log("webrtc", pc.connectionState);
    if (pc.connectionState !== "failed") return;
    if (connected) fail("the WebRTC connection was lost"); else connectFailed("WebRTC failed to connect");
  };
  dc.onmessage = (e) => onMessage(JSON.parse(e.data));
  const opened = new Promise((resolve) => { dc.onopen = resolve; });
  dc.onclose = () => { clearInterval(ping); };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((resolve) => {  // the whole offer at once (the server does not trickle)
    if (pc.iceGatheringState === "complete") return resolve();
    const timer = setTimeout(resolve, 3000);
    pc.onicegatheringstatechange = () => {
      if (pc.iceGatheringState === "complete") { clearTimeout(timer); resolve(); }
    };
  });
  const headers = { "Content-Type": "application/json", ...authHeaders() };
  const resp = await fetch("api/offer", {
    method: "POST", headers, body: JSON.stringify({ sdp: pc.localDescription.sdp, type: "offer" }),
  });
  const body = await resp.json();
  if (!resp.ok) { pc.close(); throw new Error(body.error || resp.statusText); }
  await pc.setRemoteDescription(body);
  const c = {
    send: (obj) => { if (dc.readyState === "open") dc.send(JSON.stringify(obj)); },
    close: () => { clearInterval(ping); dc.close(); pc.close(); },
  };
  const timer = setTimeout(() => connectFailed(`WebRTC did not connect within ${ICE_TIMEOUT_MS / 1000} s ` +
    "(UDP blocked? a TURN server would relay it)"), ICE_TIMEOUT_MS);
  const why = await Promise.race([opened.then(() => null), notConnected]);
  clearTimeout(timer);
  if (why) { c.close(); const err = new Error(why); err.fallback = true; throw err; }
  connected = true;
  ping = setInterval(() => c.send({ type: "ping" }), 1000);
  return c;
}

// ---- WebSocket + MSE ----------------------------------------------------------------------------------------

// A token that can travel as a WebSocket subprotocol (an HTTP token: RFC 6455 4.1); the server then takes a peer
// slot at the handshake, so the page never waits in the pre-auth pool that tokenless sockets share.
const PROTOCOL_TOKEN = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

function startWebSocket() {
  return new Promise((resolve, reject) => {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${location.pathname.replace(/[^/]*$/, "")}api/ws`;
    const bearer = token();
    const inHeader = bearer !== null && PROTOCOL_TOKEN.test(bearer);
    const ws = inHeader ? new WebSocket(url, ["stagecast", `bearer.${bearer}`]) : new WebSocket(url);
    ws.binaryType = "arraybuffer";
    let buffer = null; const pending = [];
    const video = $("video");
    const pump = () => {
      if (buffer && !buffer.updating && pending.length) buffer.appendBuffer(pending.shift());
      // stay live: jump forward when playback falls more than a second behind what arrived
      if (buffer && buffer.buffered.length) {
        const end = buffer.buffered.end(buffer.buffered.length - 1);
        if (end - video.currentTime > 1.0) video.currentTime = end - 0.1;
      }
    };
    const c = {
      tokenInHeader: inHeader,
      send: (obj) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(obj)); },
      close: () => ws.close(),
      init: (mime) => {
        if (!window.MediaSource || !MediaSource.isTypeSupported(mime)) {
          log("error", `this browser cannot play ${mime}`); return;
        }
        const ms = new MediaSource();
        buffer = null; pending.length = 0;
        video.srcObject = null;
        video.src = URL.createObjectURL(ms);
        ms.addEventListener("sourceopen", () => {
          buffer = ms.addSourceBuffer(mime);
          buffer.mode = "segments";
          buffer.addEventListener("updateend", pump);
          pump();
          video.play().catch(() => {});
        });
      },
    };
    ws.onopen = () => resolve(c);
    // A refused handshake (a token not valid, no peer slot free) shows the browser no reason: say which it may be.
    ws.onerror = () => reject(new Error(inHeader ? "the WebSocket handshake was refused (a token that is not valid, " +
      "or no peer slot free)" : "WebSocket failed"));
    ws.onclose = (e) => {
      log("websocket", `closed ${e.code} ${e.reason}`);
      if (state.running && conn === c) fail(`the WebSocket closed (${e.code}${e.reason ? ` ${e.reason}` : ""})`);
    };
    ws.onmessage = (e) => {
      if (typeof e.data === "string") onMessage(JSON.parse(e.data));
      else { pending.push(e.data); pump(); }
    };
  });
}

// ---- controls -----------------------------------------------------------------------------------------------

async function start() {
  if (conn) { conn.close(); conn = null; }
  resetStats();
  let transport = document.querySelector("input[name=transport]:checked").value;
  if (transport === "webrtc" && !window.RTCPeerConnection && !$("webcam").checked) {
    log("webrtc", "this browser has no WebRTC: using the WebSocket"); transport = "ws";
  }
  state.transport = transport;
  if ($("webcam").checked && transport !== "webrtc") {
    log("error", "the webcam needs WebRTC (the WebSocket fallback carries the output only)"); return;
  }
  if ($("webcam").checked && !$("strength").value) {
    log("error", "strength: required with the webcam (one of the stream's timesteps, e.g. 500)"); return;
  }
  setStatus(`connecting (${transport}) ...`);
  try {
    conn = transport === "ws" ? await startWebSocket() : await startWebRTC();
  } catch (err) {
    if (!err.fallback || $("webcam").checked) { fail(err.message); return; }
    // The WebRTC path is blocked: the WebSocket carries the same stream through anything that carries the page.
    log("webrtc", `${err.message}: using the WebSocket`);
    transport = "ws"; state.transport = "ws"; state.fallbacks += 1;
    setStatus("connecting (ws: WebRTC did not connect) ...");
    try { conn = await startWebSocket(); } catch (err2) { fail(err2.message); return; }
  }
  t0 = performance.now();
  const cfg = config();
  // Only a token the handshake could not carry goes in the first message (it then waits in the pre-auth pool).
  if (transport === "ws" && token() && !conn.tokenInHeader) cfg.token = token();
  state.tokenInHeader = transport === "ws" ? Boolean(conn.tokenInHeader) : null;
  conn.send(cfg);
}

// ---- recording ------------------------------------------------------------------------------------------------

// The first container the browser's MediaRecorder makes: MP4 (H.264) where it can, else WebM.
const RECORD_TYPES = ["video/mp4;codecs=avc1", "video/mp4", "video/webm;codecs=vp9", "video/webm;codecs=vp8",
  "video/webm"];
let rec = null; // {armed} before the first picture; then the recording (recordBegin) until it is stopped
window.stagecastFiles = new Map();

function recordType() {
  if (!window.MediaRecorder) return null;
  return RECORD_TYPES.find((t) => MediaRecorder.isTypeSupported(t)) || null;
}

function toggleRecord() {
  if (rec && !rec.armed) { recordStop(); return; }
  if (rec && rec.armed) { rec = null; state.recording = null; showRecording(); return; }
  if (!recordType()) { log("error", "this browser cannot record video (no MediaRecorder)"); return; }
  rec = { armed: true };
  state.recording = { armed: true };
  showRecording();
  if (state.running) recordFrame(null); // a stream is on: record from now
}

function showRecording() {
  const on = Boolean(rec);
  $("record").classList.toggle("on", on);
  $("record").textContent = !on ? "Record" : rec.armed ? "Record (armed: starts at the next frame)" : "Stop recording";
}

// The picture as the viewer sees it: WebRTC's MediaStream, or the MSE player captured (only where the browser
// cannot say when each picture reaches the screen: see recordBegin).
function shownStream() {
  const video = $("video");
  if (video.srcObject instanceof MediaStream) return video.srcObject;
  return video.captureStream ? video.captureStream() : null;
}

function newRecorder(stream, type, kind) {
  const recorder = new MediaRecorder(stream, { mimeType: type });
  const parts = [];
  recorder.ondataavailable = (e) => { if (e.data && e.data.size) parts.push(e.data); };
  const done = new Promise((resolve) => {
    recorder.onstop = () => resolve(new Blob(parts, { type: recorder.mimeType || type }));
  });
  recorder.start(250);
  return { kind, recorder, done, type: recorder.mimeType || type };
}

const recentLate = []; // [{pts, late}] of the last frames told of: how late the picture now shown left the server
const told = { id: null, pts: [] }; // the pts of every frame told of in the running stream, in order

// Called on every frame the page is told of: an armed recording starts at the next picture on the screen.
function recordFrame(msg) {
  if (msg) {
    state.lastPts = msg.pts; state.lastLateMs = msg.late_ms;
    recentLate.push({ pts: msg.pts, late: msg.late_ms }); if (recentLate.length > 64) recentLate.shift();
    const id = state.started ? state.started.stream_id : null;
    if (told.id !== id) { told.id = id; told.pts = []; }
    told.pts.push(msg.pts);
  }
  if (!rec || !rec.armed || rec.waiting) return;
  const video = $("video");
  if (!video.requestVideoFrameCallback) { // no presentation times: the shown stream as it comes, stalls and all
    const stream = shownStream();
    if (stream && stream.getVideoTracks().length) recordBegin(null, stream);
    return;
  }
  const armed = rec; armed.waiting = true;
  video.requestVideoFrameCallback((now, meta) => { if (rec === armed) recordBegin(meta); });
}

// The pts of the picture on the screen: the MSE player's media time is the stream's (the gateway's fMP4 counts
// frames at 1 / fps from 0); WebRTC's frames reach the screen as they are told of, so the last one's.
function shownPts(mediaTime) {
  const mse = !($("video").srcObject instanceof MediaStream);
  if (mse) return round3(typeof mediaTime === "number" ? mediaTime : $("video").currentTime);
  return typeof state.lastPts === "number" ? round3(state.lastPts) : null;
}

// The recording holds the stream's own timeline, not the screen's: on a loaded machine pictures reach the screen in
// bursts with stalls between them, and a MediaRecorder on the video element would keep both.  So each new picture
// shown (requestVideoFrameCallback) is copied, stamped with its time in the stream (the MSE player's media time; a
// WebRTC picture's RTP timestamp, which web/rtc.py's PacedTrack advances by 1 / fps a frame at 90 kHz) and drawn
// into a canvas track at that time on the recording's clock.  The recorders run while a picture is due and pause
// once the last one drawn has had its frame time and no next one has come (the stream stalled), resuming at the next
// picture: their clock (MediaRecorder leaves paused spans out of the file) is the stream's.  A picture that came in
// a burst waits its turn; a stall costs the file at most a timer's lateness, once.  The webcam input's recorder
// pauses with the output's, so the two files share a clock.  The sidecar says what was left out (paused_s, pauses).
const RTP_CLOCK = 90000;
const RECORD_QUEUE_MAX = 64; // pictures waiting their turn (a burst): past this the oldest is drawn at once

// `meta`: the first picture's presentation (requestVideoFrameCallback); `direct`: a stream to record as it comes
// where the browser does not tell presentations.
function recordBegin(meta, direct) {
  const type = recordType(); const video = $("video");
  const started = state.started || { config: {} };
  const r = {
    armed: false, startedAt: new Date().toISOString(), switches: [], streamId: started.stream_id || null,
    config: started.config, transport: state.transport, fps: fpsOf(started.config),
    firstPts: shownPts(meta && meta.mediaTime), frames: state.frames, shown: meta ? [meta.presentationTime] : [],
    t0: performance.now(), webrtc: video.srcObject instanceof MediaStream, direct: Boolean(direct),
    queue: [], pool: [], lastDue: 0, queuedDue: 0, queuedPts: null, base: null, drawn: 0, timer: null,
    runMs: 0, runningSince: null, pausedAt: null, pausedMs: 0, pauses: 0, stopping: false, finished: false,
    rebased: false, maxGapMs: 0, lastIndex: 0,
    // WebRTC: the frame number in the stream of the first picture recorded, at most (see watchShown)
    told: { id: told.id, pts: told.pts, first: told.pts.length - 1 },
  };
  let stream = direct;
  if (!direct) {
    r.canvas = document.createElement("canvas");
    r.canvas.width = video.videoWidth || 64; r.canvas.height = video.videoHeight || 64;
    r.ctx = r.canvas.getContext("2d");
    stream = r.canvas.captureStream(0); r.track = stream.getVideoTracks()[0];
  }
  r.recorders = [newRecorder(stream, type, "output")];
  if ($("record-input").checked && camera) r.recorders.push(newRecorder(camera, type, "input"));
  // The recording's clock and the wall clock start at one instant, so that wall_s = duration_s + paused_s exactly.
  r.t0 = r.runningSince = performance.now();
  rec = r;
  if (!direct) {
    r.base = { t: pictureTime(r, meta), due: 0 }; r.queuedPts = r.base.t;
    paint(r, copyPicture(r)); watchShown(r); recTick(r);
  }
  const first = recentLate.reduce((a, f) => (a && Math.abs(a.pts - r.firstPts) <= Math.abs(f.pts - r.firstPts) ?
    a : f), null);
  r.firstLateMs = first ? first.late : state.lastLateMs;
  state.recording = { armed: false, type, startedAt: r.startedAt, shown: r.shown.length, pauses: 0 };
  showRecording();
  log("record", `recording ${type}${r.recorders.length > 1 ? " and the webcam input" : ""}`);
}

// A picture's time in the stream (s): WebRTC's RTP timestamp (mod 2^32, from the first recorded), else media time.
function pictureTime(r, meta) {
  if (r.webrtc && typeof meta.rtpTimestamp === "number") {
    if (r.rtp0 === undefined) r.rtp0 = meta.rtpTimestamp;
    const ticks = (meta.rtpTimestamp - r.rtp0) >>> 0;
    return (ticks >= 2 ** 31 ? ticks - 2 ** 32 : ticks) / RTP_CLOCK;
  }
  return meta.mediaTime;
}

// The picture on the screen now, copied (the video element shows the next one by the time its turn comes).
function copyPicture(r) {
  const video = $("video");
  const c = r.pool.pop() || document.createElement("canvas");
  if (c.width !== video.videoWidth || c.height !== video.videoHeight) {
    c.width = video.videoWidth || r.canvas.width; c.height = video.videoHeight || r.canvas.height;
  }
  c.getContext("2d").drawImage(video, 0, 0, c.width, c.height);
  return c;
}

function paint(r, picture) {
  r.ctx.drawImage(picture, 0, 0, r.canvas.width, r.canvas.height);
  r.track.requestFrame();
  r.drawn += 1;
  r.pool.push(picture);
}

// The recording's clock (ms): time the recorders ran.
function recClockMs(r, now) { return r.runMs + (r.runningSince === null ? 0 : now - r.runningSince); }

function recRun(r, now) {
  if (r.runningSince !== null) return;
  r.recorders.forEach((x) => { if (x.recorder.state === "paused") x.recorder.resume(); });
  r.pausedMs += now - r.pausedAt; r.pausedAt = null; r.runningSince = now;
}

function recHold(r, now) {
  if (r.runningSince === null) return;
  r.recorders.forEach((x) => { if (x.recorder.state === "recording") x.recorder.pause(); });
  r.runMs += now - r.runningSince; r.runningSince = null; r.pausedAt = now; r.pauses += 1;
  if (state.recording && rec === r) state.recording.pauses = r.pauses;
}

// Draw every picture whose time has come; run while one is due, hold once the last drawn has had its frame time.
function recTick(r) {
  if (r.finished) return;
  clearTimeout(r.timer); r.timer = null;
  const now = performance.now(); const c = recClockMs(r, now);
  while (r.queue.length && (r.queue[0].due * 1000 <= c + 1 || r.queue.length > RECORD_QUEUE_MAX)) {
    const next = r.queue.shift(); paint(r, next.picture); r.lastDue = next.due;
  }
  let wait;
  if (r.queue.length) {
    recRun(r, now); wait = r.queue[0].due * 1000 - c;
  } else {
    const held = (r.lastDue + 1 / r.fps) * 1000; // the last picture's own frame time
    if (c >= held - 1) {
      if (r.stopping) { recFinish(r); return; }
      recHold(r, now); return; // no next picture yet: the stream stalled
    }
    recRun(r, now); wait = held - c;
  }
  r.timer = setTimeout(() => recTick(r), Math.max(0, wait));
}

// Each new picture shown while recording: its presentation time (what the screen showed) and, in the queue, its
// time on the recording's clock.  A picture earlier in the stream than the last (a new stream, a seek) follows the
// last one by a frame time.
function watchShown(r) {
  const video = $("video");
  const onFrame = (now, meta) => {
    if (rec !== r) return;
    r.maxGapMs = Math.max(r.maxGapMs, meta.presentationTime - r.shown[r.shown.length - 1]);
    r.shown.push(meta.presentationTime);
    if (state.recording) state.recording.shown = r.shown.length;
    const t = pictureTime(r, meta);
    let due = r.base.due + (t - r.base.t);
    if (due < r.queuedDue - 1e-4) { r.base = { t, due: r.queuedDue + 1 / r.fps }; due = r.base.due; r.rebased = true; }
    if (webrtcCounted(r)) {
      // The k-th frame after the first recorded one is on the screen, so its frame was told of (the message leaves
      // the web process before the frame is encoded): the first recorded is at most the frames told of less k + 1.
      r.lastIndex = Math.round(t * r.fps);
      r.told.first = Math.min(r.told.first, told.pts.length - 1 - r.lastIndex);
    }
    if (due > r.queuedDue + 1e-4) { // a new picture (not the last one again)
      r.queue.push({ due, picture: copyPicture(r) }); r.queuedDue = due; r.queuedPts = t;
      recTick(r);
    }
    video.requestVideoFrameCallback(onFrame);
  };
  video.requestVideoFrameCallback(onFrame);
}

// WebRTC pictures counted in frames from the first recorded, in the stream that was on then (RTP timestamps).
function webrtcCounted(r) { return r.webrtc && r.rtp0 !== undefined && !r.rebased && r.told.id === told.id; }

// A switch's time on the recording's clock: that of the picture on the screen when the page was told of it.
function recordSwitch(prompt) {
  if (!rec || rec.armed) return;
  rec.switches.push({
    prompt,
    at_s: round3(rec.direct ? (performance.now() - rec.t0) / 1000 : rec.queuedDue),
    // the pts of the picture on the screen then: the last one shown (MSE: its media time, which the player's clock,
    // read now, runs past when a loaded browser skips pictures; WebRTC: see recFinish)
    stream_s: rec.webrtc || rec.queuedPts === null ? shownPts() : round3(rec.queuedPts),
    index: webrtcCounted(rec) ? rec.lastIndex : null,
  });
}

// After the stream's end the last pictures still reach the screen (the web process's encoder, RTP and the jitter
// buffer, or up to a second of the MSE player's: pump), seconds later on a loaded machine: the recording stops once
// the last frame is on the screen (the MSE player holds nothing more to play; WebRTC's picture of the last frame
// told of, counted from a recording that began at the stream's first) and no new picture came for
// RECORD_QUIET_FRAMES frame times.  A WebRTC recording begun later in the stream stops once no picture came for
// twice the longest stall it saw (or RECORD_QUIET_FRAMES frame times); any after RECORD_DRAIN_MAX_MS.
const RECORD_QUIET_FRAMES = 2;
const RECORD_DRAIN_MAX_MS = 10000;

function recordEnd() {
  if (!rec || rec.armed) return;
  const r = rec; const video = $("video"); const ended = performance.now();
  const quietMs = (RECORD_QUIET_FRAMES * 1000) / r.fps;
  const check = () => {
    if (rec !== r) return;
    const now = performance.now(); const b = video.buffered;
    const last = r.shown.length ? r.shown[r.shown.length - 1] : ended;
    const quiet = now - Math.max(last, ended);
    const played = r.webrtc ? webrtcCounted(r) && r.lastIndex >= told.pts.length - 1 :
      !b.length || video.paused || video.currentTime >= b.end(b.length - 1) - 0.1;
    const stalled = r.webrtc && !played && quiet >= Math.max(quietMs, 2 * r.maxGapMs);
    if ((played && quiet >= quietMs) || stalled || now - ended > RECORD_DRAIN_MAX_MS) recordStop();
    else setTimeout(check, 20);
  };
  check();
}

function fpsOf(config) { return (config && config.target_fps) || 16; }

function round3(x) { return Math.round(x * 1000) / 1000; }

// Stop taking pictures; the ones waiting their turn are still drawn, then the recorders stop (recFinish).
function recordStop() {
  const r = rec; rec = null; showRecording();
  if (!r || r.armed) { state.recording = null; return; }
  r.stopping = true;
  if (r.direct) recFinish(r); else recTick(r);
}

async function recFinish(r) {
  if (r.finished) return;
  r.finished = true; clearTimeout(r.timer);
  const now = performance.now();
  if (r.pausedAt !== null) { r.pausedMs += now - r.pausedAt; r.pausedAt = null; } // stopped in a stall
  const durationS = round3((r.direct ? now - r.t0 : recClockMs(r, now)) / 1000);
  const wallS = round3((now - r.t0) / 1000);
  if (r.webrtc && r.rtp0 !== undefined && r.told.pts.length) { // the pts of the pictures, by their frame numbers
    const first = Math.max(0, r.told.first); const pts = (i) => r.told.pts[Math.min(i, r.told.pts.length - 1)];
    r.firstPts = round3(pts(first));
    r.switches.forEach((x) => { if (x.index !== null) x.stream_s = round3(pts(first + x.index)); });
  }
  r.switches.forEach((x) => { delete x.index; });
  r.recorders.forEach((x) => x.recorder.stop());
  const blobs = await Promise.all(r.recorders.map((x) => x.done));
  const stamp = r.startedAt.replace(/[:.]/g, "-");
  const files = r.recorders.map((x, i) => {
    const ext = x.type.startsWith("video/mp4") ? "mp4" : "webm";
    const name = `stagecast-${stamp}${x.kind === "input" ? "-input" : ""}.${ext}`;
    return { kind: x.kind, type: x.type, blob: blobs[i], name };
  });
  const sidecar = {
    file: files[0].name, input_file: files[1] ? files[1].name : null, type: files[0].type,
    started_at: r.startedAt, stream_id: r.streamId, transport: r.transport, config: r.config,
    // the file's timeline (the recording's clock) and the stalls left out of it: wall_s = duration_s + paused_s
    duration_s: durationS, wall_s: wallS, paused_s: r.direct ? null : round3(r.pausedMs / 1000),
    pauses: r.direct ? null : r.pauses, frames: r.direct ? null : r.drawn,
    first_pts_s: r.firstPts === undefined ? null : r.firstPts,
    // how late the last frame left the web process (a server slower than real time)
    last_frame_late_s: typeof state.lastLateMs === "number" ? round3(state.lastLateMs / 1000) : null,
    // and how late the first picture recorded did
    first_frame_late_s: typeof r.firstLateMs === "number" ? round3(r.firstLateMs / 1000) : null,
    // the pictures the screen showed while recording: how many, and from the first to the last one's end (stalls in)
    shown_frames: r.shown.length,
    shown_s: r.shown.length ? round3((r.shown[r.shown.length - 1] - r.shown[0]) / 1000 + 1 / r.fps) : null,
    prompt: r.config && r.config.prompt !== undefined ? r.config.prompt : null, prompt_switches: r.switches,
  };
  const json = new Blob([JSON.stringify(sidecar, null, 2)], { type: "application/json" });
  files.push({ kind: "sidecar", type: "application/json", blob: json, name: `stagecast-${stamp}.json` });
  const li = document.createElement("li");
  for (const f of files) {
    const a = document.createElement("a");
    a.href = URL.createObjectURL(f.blob); a.download = f.name; a.textContent = f.name;
    li.append(a); f.url = a.href;
    window.stagecastFiles.set(f.url, f.blob); // what the page saved, by its download URL (tests read it)
  }
  $("recordings").prepend(li);
  const listed = files.map(({ kind, type, name, url, blob }) => ({ kind, type, name, url, bytes: blob.size }));
  state.recordings.push({ files: listed, sidecar });
  if (!rec) state.recording = null;
  log("record", `saved ${files.map((f) => f.name).join(", ")}` +
    (r.pauses ? ` (${r.pauses} stalls, ${sidecar.paused_s} s, left out)` : ""));
}

// ---- the playout clock: is the picture late? ---------------------------------------------------------------

// Lateness as a player with PLAYOUT_BUFFER_S buffered sees it, not from the first frame: its clock starts at the
// stream's first frame once frames that far past it have come (the buffer is full), and a frame is late when it
// comes after its time on that clock; the player then waits (stalls) that long and its clock moves on by as much.
// So a stream's start (its first frame alone, the next chunk a chunk later) is not late, and a server slower than
// real time is: the player waits for every chunk.
const PLAYOUT_BUFFER_S = 0.5;
const STALL_WARN_MS = 100; // the player waited this long in the last second: say why
let playout = null; // the running stream's clock

function newPlayout(fps) {
  return { fps, firstPts: null, lastPts: null, startAt: null, shiftMs: 0, stalls: [] };
}

function dueAt(p, pts) { return p.startAt + (pts - p.firstPts) * 1000 + p.shiftMs; }

// The frame of `pts` (s) came at `now` (ms): how long the player waited for it (0: in time; null: still buffering).
function playoutFrame(p, pts, now) {
  if (typeof pts !== "number") return null;
  if (p.firstPts === null) p.firstPts = pts;
  p.lastPts = p.lastPts === null ? pts : Math.max(p.lastPts, pts);
  if (p.startAt === null) {
    if (pts - p.firstPts < PLAYOUT_BUFFER_S) return null;
    p.startAt = now; // the buffer is full: the first frame plays now
    return 0;
  }
  const waited = Math.max(0, now - dueAt(p, pts));
  if (waited > 0) { p.shiftMs += waited; p.stalls.push({ at: now, ms: waited }); }
  return waited;
}

// How long the player waited in the second before `now`: stalls ended in it, and the one going on (the next frame
// due and not come).
function waitedMs(p, now) {
  if (!p || p.startAt === null) return 0;
  p.stalls = p.stalls.filter((s) => now - s.at < 1000);
  const ended = p.stalls.reduce((a, s) => a + Math.min(s.ms, 1000 - (now - s.at)), 0); // the part in it
  const waiting = Math.max(0, now - dueAt(p, p.lastPts + 1 / p.fps));
  return Math.min(1000, ended + waiting);
}

function drawSpark() {
  const now = performance.now();
  windowFrames = windowFrames.filter((f) => now - f.at < 1000);
  const fps = windowFrames.length;
  const ontime = fps ? windowFrames.filter((f) => f.late <= 20).length / fps : null;
  if (state.started) {
    $("fps").textContent = fps.toFixed(0);
    if (ontime !== null) $("ontime").textContent = `${Math.round(ontime * 100)}%`;
  }
  $("late-reason").textContent = lateReason(now);
  $("late-reason").hidden = !$("late-reason").textContent;
  state.lateReason = $("late-reason").textContent;
  perSecond.push({ fps, ontime });
  if (perSecond.length > 60) perSecond.shift();
  const canvas = $("spark"); const g = canvas.getContext("2d");
  g.clearRect(0, 0, canvas.width, canvas.height);
  const target = (state.started && state.started.config.target_fps) || 16;
  const line = (color, value) => {
    g.strokeStyle = color; g.beginPath();
    perSecond.forEach((p, i) => {
      const v = value(p); if (v === null) return;
      const x = (i / 59) * (canvas.width - 1), y = canvas.height - 1 - Math.min(1, v) * (canvas.height - 2);
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    });
    g.stroke();
  };
  line("#6c6", (p) => p.fps / (target * 1.25));
  line("#69f", (p) => p.ontime);
}

// Why the picture is late, judged on the playout clock (nothing while its buffer fills): frames held in this page's
// encoder, or late from the server already.
function lateReason(now) {
  if (!state.running || !playout || playout.startAt === null) return "";
  const waited = waitedMs(playout, now);
  if (waited < STALL_WARN_MS) return "";
  if (!windowFrames.length) return "no frames this second: the server is behind (fewer steps or a smaller size helps)";
  // Frames the server sent late leave the web process as soon as they are encoded: their hold is the encoder's.
  const late = windowFrames.filter((f) => f.late > 20);
  const held = late.length ? late.reduce((a, f) => a + f.held, 0) / late.length : 0;
  if (held > 50) return `frames wait ${Math.round(held)} ms in the web process's encoder (CPU)`;
  return `frames arrive late: playback waited ${Math.round(waited)} ms in the last second; the server makes fewer ` +
    `than ${state.started.config.target_fps} fps at this size and steps (fewer steps or a smaller size helps)`;
}

async function init() {
  try { info = await (await fetch("api/info")).json(); } catch (err) { log("error", "no /api/info"); }
  $("token-row").hidden = !info.token_required;
  allSizes = [...$("size").options].map((o) => ({ value: o.value, text: o.textContent }));
  if (!info.token_required || token()) loadBudget();
  $("token").onchange = () => { if (token()) loadBudget(); };
  $("steps").oninput = offerSizes;
  if (!window.RTCPeerConnection) {  // e.g. WebRTC disabled by policy: the WebSocket is the only way
    document.querySelector("input[name=transport][value=ws]").checked = true;
    document.querySelector("input[name=transport][value=webrtc]").disabled = true;
    $("webcam").disabled = true;
    log("webrtc", "this browser has no WebRTC: the page uses the WebSocket");
  }
  $("start").onclick = start;
  $("update").onclick = () => conn && conn.send({ type: "prompt", prompt: $("prompt").value });
  $("stop").onclick = () => conn && conn.send({ type: "stop" });
  $("record").onclick = toggleRecord;
  $("webcam").onchange = () => {
    if (!$("webcam").checked && camera) {
      camera.getTracks().forEach((t) => t.stop()); camera = null; $("camera").hidden = true;
    }
  };
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !$("update").disabled) { e.preventDefault(); $("update").click(); }
  });
  setInterval(drawSpark, 1000);
  state.ready = true;
}
init();
