"""A vocabulary split over the ranks of a group: the per-rank summaries and their exact merge
(`merge`), and the step that runs the definition on one rank's slice (`step.SplitStep`)."""
