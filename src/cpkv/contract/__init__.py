"""The contract every consumer relies on: layout arithmetic, owner plans (W1),
owner-lane allocation (W2) and the errors that refuse a plan."""
