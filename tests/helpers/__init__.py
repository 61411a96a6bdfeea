"""What several test modules share: tiny models and heads, tree and sampling checks, the SGLang test environment."""
