"""How the legs of one request are driven, one module per KV-transfer flow."""
