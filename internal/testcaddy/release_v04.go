package testcaddy

// ReleaseV04 is v0.4.0's commit (the fourth wave, the base of the fifth):
// the tests of what this release changed in what Redis holds (learned
// usage, fleet records) run it beside this build. PreviousRelease moves to
// it when this release is cut.
const ReleaseV04 = "6ef2a46877bb2eeb72880f3d8fcbd52ac8770d2c"
