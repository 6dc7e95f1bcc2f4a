"""The gateway's public edge: RPC handlers, config parsing, admission, quotas, revocation, status and the stream
table."""
