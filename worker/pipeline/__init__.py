"""The request pipeline both batching loops call: entries, jobs, batch outcomes, answers."""
