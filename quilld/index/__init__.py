"""Identity scopes and the guard that keeps blocks inside them."""
