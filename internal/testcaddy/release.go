package testcaddy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// PreviousRelease is the commit of the release before this one (v0.3.0,
// see CHANGELOG.md): what a fleet in the middle of a rolling upgrade runs
// beside this build. The upgrade tests build it from the repository's
// history. Move it forward with each release.
const PreviousRelease = "675d57770cecaef88c5c6500878767667e23bbff"

// ReleaseV02 is v0.2.0's commit, whose reading of what later releases
// write (a quota count, a v2 bucket) the format tests still hold: a fleet
// may roll back that far.
const ReleaseV02 = "ed062f7f7497450c6d5704a51f6077c1e1f642d8"

// BuildRelease builds the Caddy command with the module as it was at
// commit into out: the commit's tree, from the git history of the
// repository holding dir, is extracted into a temporary directory and
// built there with the same module cache. It must run inside a clone with
// that history (not a shallow one).
func BuildRelease(dir, commit, out string) error {
	top, err := exec.Command("git", "-C", dir, "rev-parse", "--show-toplevel").Output()
	if err != nil {
		return fmt.Errorf("finding the repository: %v (the upgrade tests need a git clone)", err)
	}
	repo := strings.TrimSpace(string(top))
	if err := exec.Command("git", "-C", repo, "cat-file", "-e", commit+"^{commit}").Run(); err != nil {
		return fmt.Errorf("commit %s of the previous release is not in %s's history (a shallow clone? git fetch --unshallow): %v", commit, repo, err)
	}
	src, err := os.MkdirTemp("", "rate-limit-release-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(src)
	archive := exec.Command("sh", "-c", `git -C "$1" archive "$2" | tar -x -C "$3"`, "sh", repo, commit, src)
	archive.Stderr = os.Stderr
	if err := archive.Run(); err != nil {
		return fmt.Errorf("extracting %s: %v", commit, err)
	}
	abs, err := filepath.Abs(out)
	if err != nil {
		return err
	}
	build := exec.Command("go", "build", "-o", abs, Package)
	build.Dir = src
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	// The extracted tree is not a repository: no VCS stamping.
	build.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false")
	if err := build.Run(); err != nil {
		return fmt.Errorf("building %s: %v", commit, err)
	}
	return nil
}
