// stagecast live page: WebRTC (video track + "control" data channel) or the WebSocket fallback (fMP4 into MSE).
// Control messages are the same on both: config, prompt, stop, ping; the server answers started, frame (stats),
// prompt_updated, end, error.  window.stagecast exposes the page's state (tests read it).
"use strict";

const $ = (id) => document.getElementById(id);
const state = (window.stagecast = {
  transport: null, started: null, frames: 0, firstFrameMs: null, promptUpdates: [], ends: [], errors: [],
  events: [], framesReceived: 0,
});
let info = { token_required: false, ice_servers: [] };
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

function setStatus(text) { $("status").textContent = text; }

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
      state.started = msg; state.frames = 0; state.firstFrameMs = null; windowFrames = [];
      setStatus(`streaming ${msg.config.width}×${msg.config.height} @ ${msg.config.target_fps} fps, ` +
        `${msg.config.steps} steps`);
      log("started", `stream ${msg.stream_id}, seed ${msg.config.seed}`);
      $("update").disabled = false; $("stop").disabled = false;
      break;
    case "frame": {
      const now = performance.now();
      if (state.firstFrameMs === null) {
        state.firstFrameMs = now - t0;
        $("ttff").textContent = `${(state.firstFrameMs / 1000).toFixed(2)} s`;
      }
      state.frames += 1; state.framesReceived += 1;
      windowFrames.push({ at: now, late: msg.late_ms });
      $("frames").textContent = state.frames;
      break;
    }
    case "prompt_updated":
      state.promptUpdates.push(msg.prompt); log("prompt_updated", msg.prompt); break;
    case "end":
      state.ends.push(msg); log("end", `${msg.reason} after ${msg.frames} frames`); setStatus(`ended: ${msg.reason}`);
      $("update").disabled = true; $("stop").disabled = true;
      break;
    case "error":
      state.errors.push(msg); log("error", `${msg.code}: ${msg.message}`); break;
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
  pc.onconnectionstatechange = () => {
    log("webrtc", pc.connectionState);
    if (pc.connectionState === "failed") setStatus("WebRTC failed: try the WebSocket");
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
  const headers = { "Content-Type": "application/json" };
  if (token()) headers.Authorization = `Bearer ${token()}`;
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
  await opened;
  ping = setInterval(() => c.send({ type: "ping" }), 1000);
  return c;
}

// ---- WebSocket + MSE ----------------------------------------------------------------------------------------

function startWebSocket() {
  return new Promise((resolve, reject) => {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}${location.pathname.replace(/[^/]*$/, "")}api/ws`;
    const ws = new WebSocket(url);
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
    ws.onerror = () => reject(new Error("WebSocket failed"));
    ws.onclose = (e) => log("websocket", `closed ${e.code} ${e.reason}`);
    ws.onmessage = (e) => {
      if (typeof e.data === "string") onMessage(JSON.parse(e.data));
      else { pending.push(e.data); pump(); }
    };
  });
}

// ---- controls -----------------------------------------------------------------------------------------------

async function start() {
  if (conn) { conn.close(); conn = null; }
  const transport = document.querySelector("input[name=transport]:checked").value;
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
    setStatus("not connected"); log("error", err.message); state.errors.push({ message: err.message }); return;
  }
  t0 = performance.now();
  const cfg = config();
  if (transport === "ws" && token()) cfg.token = token();
  conn.send(cfg);
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

async function init() {
  try { info = await (await fetch("api/info")).json(); } catch (err) { log("error", "no /api/info"); }
  $("token-row").hidden = !info.token_required;
  $("start").onclick = start;
  $("update").onclick = () => conn && conn.send({ type: "prompt", prompt: $("prompt").value });
  $("stop").onclick = () => conn && conn.send({ type: "stop" });
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
