"""``selfrl run``: the batch recipe that composes the components below it."""
