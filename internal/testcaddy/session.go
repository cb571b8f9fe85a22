package testcaddy

import (
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
)

// Session is the testredis.TB (and so this package's) of a program that
// is not a test: it owns a temporary directory and runs the cleanups of every
// process it started, last first, when the demo ends, fails or is
// interrupted.
type Session struct {
	name     string
	mu       sync.Mutex
	dir      string
	n        int
	cleanups []func()
	closing  bool
	once     sync.Once
}

func NewSession(name string) *Session {
	dir, err := os.MkdirTemp("", "rate-limit-"+name+"-")
	if err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		os.Exit(1)
	}
	return &Session{name: name, dir: dir}
}

func (s *Session) Helper() {}

func (s *Session) Fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, s.name+": "+format+"\n", args...)
	s.Close()
	os.Exit(1)
}

// Cleanup registers f to run when the session closes; once it is closing
// (on a signal, while the demo goes on starting processes), f runs at once.
func (s *Session) Cleanup(f func()) {
	s.mu.Lock()
	closing := s.closing
	if !closing {
		s.cleanups = append(s.cleanups, f)
	}
	s.mu.Unlock()
	if closing {
		f()
	}
}

func (s *Session) TempDir() string {
	s.mu.Lock()
	if s.closing { // stopping on a signal: start nothing more, the exit is coming
		s.mu.Unlock()
		select {}
	}
	s.n++
	dir := filepath.Join(s.dir, strconv.Itoa(s.n))
	s.mu.Unlock()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		s.Fatalf("%v", err)
	}
	return dir
}

// CloseOnSignal stops everything on Ctrl-C or SIGTERM, then exits with
// status code (130 for an interrupted run; 0 where Ctrl-C is the way to
// end it); say, when not nil, tells what is being stopped.
func (s *Session) CloseOnSignal(say func() string, code int) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	go func() {
		got := <-sig
		if say != nil {
			fmt.Fprintf(os.Stderr, "\n%s: %v: %s\n", s.name, got, say())
		}
		s.Close()
		os.Exit(code)
	}()
}

// Close stops everything, once; a second caller waits for the first.
func (s *Session) Close() {
	s.once.Do(func() {
		s.mu.Lock()
		fs := s.cleanups
		s.cleanups, s.closing = nil, true
		s.mu.Unlock()
		for i := len(fs) - 1; i >= 0; i-- {
			fs[i]()
		}
		os.RemoveAll(s.dir)
	})
}
