package testcaddy

import (
	"sync"
	"time"
)

// Paced offers rate requests per second for d, from at most workers at
// once: request n, offered at since the start, is made by do(n, at) on one
// of the workers; a tick that finds every worker busy is skipped, so a slow
// answer (a held denial) never makes the load burst afterwards. It returns
// once every request offered is answered, with how many were.
func Paced(rate int, d time.Duration, workers int, do func(n int, at time.Duration)) (sent int) {
	type job struct {
		n  int
		at time.Duration
	}
	jobs := make(chan job)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				do(j.n, j.at)
			}
		}()
	}
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	begin := time.Now()
	for {
		at := time.Since(begin)
		if at >= d {
			break
		}
		select {
		case jobs <- job{sent, at}:
			sent++
		default: // every worker busy: this tick's request is not sent
		}
		<-tick.C
	}
	close(jobs)
	wg.Wait()
	return sent
}
