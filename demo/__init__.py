"""The shipped demo: a trained pair (pair/), held-out prompts, the recipe that built them."""
