"""Next-token sampling and structured outputs (grammar masks)."""
