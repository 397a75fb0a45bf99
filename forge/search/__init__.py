"""forge recipe search: the recipe with the least measured KL divergence within a size budget."""
