"""The shipped demo: a trained pair (pair/), held-out prompts (tools/demo_recipe.py is the recipe that built them)."""
