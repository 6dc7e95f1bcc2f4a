"""The browser edge: a live page, WebRTC and a WebSocket fallback, in front of a gateway's public gRPC API."""
